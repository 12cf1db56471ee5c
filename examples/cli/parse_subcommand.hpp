#pragma once
// The one CLI11 parse step of every `kvkit` command: help, --help-all and --version print
// and end the command with exit code 0; any other parse error is a usage error handed to
// the command's own reporter (each command keeps its exact message format and code).

#include <CLI/CLI.hpp>

#include <functional>
#include <iostream>
#include <string>

namespace kvkit {
namespace cli {

/// parse_subcommand's answer when the command should go on and run.
constexpr int kParsed = -1;

/// Parses argv into `app`. Returns kParsed when the command should run; 0 after printing
/// help (--help, --help-all) or the version on stdout; for a usage error, whatever
/// `usage_error(2, message)` returns (or throws: kvkit's top-level parser turns it into its
/// UsageError). A function rather than a copied try block so that every command answers
/// --help and a bad option the same way.
inline int parse_subcommand(CLI::App& app, int argc, char** argv,
                         const std::function<int(int, const std::string&)>& usage_error) {
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp&) {
    std::cout << app.help();
    return 0;
  } catch (const CLI::CallForAllHelp&) {
    std::cout << app.help("", CLI::AppFormatMode::All);
    return 0;
  } catch (const CLI::CallForVersion& e) {
    std::cout << e.what() << "\n";
    return 0;
  } catch (const CLI::ParseError& e) {
    return usage_error(2, e.what());
  }
  return kParsed;
}

}  // namespace cli
}  // namespace kvkit
