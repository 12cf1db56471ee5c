#pragma once
// Running the built `kvkit` binary (KVKIT_CLI_PATH) from tests: a per-test temporary
// folder, the model files of KVKIT_MODEL_DIR, the exit code with stdout and stderr, and
// (with nlohmann/json included first) the one JSON object of a --json run that must succeed.

#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <system_error>

namespace kvkit {
namespace test {

/// A fresh temporary folder named after the test binary's tag and pid, removed at the end
/// of the scope.
struct TempDir {
  std::filesystem::path path;
  explicit TempDir(const std::string& tag) {
    path = std::filesystem::temp_directory_path() / ("kvkit_test_" + tag + "_" + std::to_string(::getpid()));
    std::filesystem::remove_all(path);
    std::filesystem::create_directories(path);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  std::string file(const std::string& name) const { return (path / name).string(); }
};

/// The model files the CLI tests run (CI's sanitizer build has only stories260K).
inline const std::string kStoriesPath = std::string(KVKIT_MODEL_DIR) + "/stories260K.bin";
inline const std::string kSmolPath = std::string(KVKIT_MODEL_DIR) + "/SmolLM2-135M-Instruct.Q4_1.gguf";

/// `--model 'stories260K.bin' ` when the file is there, else "" and a warning: the CLI's
/// synthetic model has the same shape, so the test runs either way.
inline std::string model_arg() {
  if (std::filesystem::exists(kStoriesPath)) return "--model '" + kStoriesPath + "' ";
  WARN("no model file " << kStoriesPath << ": using the synthetic model");
  return "";
}

inline std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

struct CliResult {
  int code = -1;
  std::string out, err;
};

/// Runs `kvkit <args>` (args already shell-quoted where needed).
inline CliResult run_cli(const std::string& args) {
  static int counter = 0;
  TempDir tmp("cli_run" + std::to_string(counter++));
  const std::string out = tmp.file("out.txt"), err = tmp.file("err.txt");
  const std::string cmd = std::string("'") + KVKIT_CLI_PATH + "' " + args + " >'" + out + "' 2>'" + err + "'";
  const int status = std::system(cmd.c_str());
  CliResult r;
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  r.out = slurp(out);
  r.err = slurp(err);
  return r;
}

#ifdef NLOHMANN_JSON_VERSION_MAJOR
/// Runs a command expected to succeed with --json and parses its one JSON object.
inline nlohmann::json run_json(const std::string& args) {
  const CliResult r = run_cli(args);
  INFO("kvkit " << args << "\nstderr: " << r.err);
  REQUIRE(r.code == 0);
  return nlohmann::json::parse(r.out);  // throws on anything but exactly one JSON value
}
#endif

}  // namespace test
}  // namespace kvkit
