#pragma once
// Errors and statuses.
//
// Configuration mistakes (bad shapes, out-of-range ids, unsupported sizes) throw
// kvkit::Error at the point they are detected, with the offending value in the message.
// Run paths and I/O return kvkit::Status instead and never throw, so a kernel launch
// or a store round trip can fail without unwinding through an engine's hot loop.
// Define KVKIT_NO_EXCEPTIONS to turn every throw into a message on stderr + abort; a
// build with exceptions disabled (-fno-exceptions, /EHs-c-) gets the same automatically.

/// 1 when the compiler accepts try/catch/throw (__cpp_exceptions, or GCC's __EXCEPTIONS
/// / MSVC's _CPPUNWIND), 0 under -fno-exceptions. Independent of KVKIT_NO_EXCEPTIONS,
/// which only stops kvkit itself from throwing: code that must catch a standard-library
/// exception (parallel_for's refused thread) still does when the compiler allows it.
#if defined(__cpp_exceptions) || defined(__EXCEPTIONS) || defined(_CPPUNWIND)
#define KVKIT_HAS_EXCEPTIONS 1
#else
#define KVKIT_HAS_EXCEPTIONS 0
#endif

#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace kvkit {

/// The exception every configuration error raises; what() names the bad value.
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

/// Coarse failure classes, so callers can branch without parsing messages.
enum class StatusCode : int {
  kOk = 0,
  kInvalidArgument,
  kOutOfRange,
  kWrongMemorySpace,
  kUnsupported,
  kIoError,
  kNotFound,
  kCorrupt,
  kTimeout,
  kDeviceError,
};

/// Short lower-case name of a status code, as Status::to_string() prints it.
inline const char* to_string(StatusCode c) {
  switch (c) {
    case StatusCode::kOk: return "ok";
    case StatusCode::kInvalidArgument: return "invalid argument";
    case StatusCode::kOutOfRange: return "out of range";
    case StatusCode::kWrongMemorySpace: return "wrong memory space";
    case StatusCode::kUnsupported: return "unsupported";
    case StatusCode::kIoError: return "i/o error";
    case StatusCode::kNotFound: return "not found";
    case StatusCode::kCorrupt: return "corrupt";
    case StatusCode::kTimeout: return "timeout";
    case StatusCode::kDeviceError: return "device error";
  }
  return "unknown";
}

/// Result of a run-path call: ok, or a code plus a human-readable message.
/// [[nodiscard]] so a dropped failure is a compiler warning (an error under -Werror).
class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}
  static Status ok() { return Status(); }

  bool is_ok() const { return code_ == StatusCode::kOk; }
  explicit operator bool() const { return is_ok(); }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  std::string to_string() const {
    if (is_ok()) return "ok";
    return std::string(kvkit::to_string(code_)) + ": " + message_;
  }
  /// Converts a failed status into an Error (for callers that prefer exceptions).
  void throw_if_error() const;

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

namespace detail {

template <class... Args>
std::string concat(Args&&... args) {
  std::ostringstream os;
  (os << ... << std::forward<Args>(args));
  return os.str();
}

[[noreturn]] inline void raise(const std::string& msg) {
#if defined(KVKIT_NO_EXCEPTIONS) || !KVKIT_HAS_EXCEPTIONS
  std::fprintf(stderr, "kvkit: %s\n", msg.c_str());
  std::abort();
#else
  throw Error(msg);
#endif
}

}  // namespace detail

inline void Status::throw_if_error() const {
  if (!is_ok()) detail::raise(to_string());
}

/// Throws kvkit::Error("kvkit: " + message) built from the streamed arguments.
template <class... Args>
[[noreturn]] void fail(Args&&... args) {
  detail::raise(detail::concat(std::forward<Args>(args)...));
}

/// Builds a failed Status from streamed arguments.
template <class... Args>
Status make_status(StatusCode code, Args&&... args) {
  return Status(code, detail::concat(std::forward<Args>(args)...));
}

}  // namespace kvkit

/// Throws kvkit::Error with the streamed message when `cond` is false.
#define KVKIT_CHECK(cond, ...)                                  \
  do {                                                          \
    if (!(cond)) ::kvkit::fail(__VA_ARGS__);                    \
  } while (0)

/// Returns a failed Status from the enclosing function when `cond` is false.
#define KVKIT_CHECK_STATUS(cond, code, ...)                     \
  do {                                                          \
    if (!(cond)) return ::kvkit::make_status(code, __VA_ARGS__); \
  } while (0)

/// Propagates a failed Status.
#define KVKIT_RETURN_IF_ERROR(expr)                             \
  do {                                                          \
    ::kvkit::Status kvkit_status_ = (expr);                     \
    if (!kvkit_status_.is_ok()) return kvkit_status_;           \
  } while (0)
