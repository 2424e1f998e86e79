// kvq/core/status.hpp — how host APIs report bad input.
//
// Low-level operations (append, attention, launchers) return a Status and write
// nothing when it is not ok. Owning host classes (the host KV cache, file readers)
// throw kvq::Error carrying the same code and message.
#pragma once

#include <stdexcept>
#include <string>
#include <utility>

namespace kvq {

enum class StatusCode {
  ok = 0,
  invalid_argument,  // null pointer, wrong shape, inconsistent sizes
  out_of_range,      // page index, position or length outside what the caller described
  unsupported,       // a run-time value that no instantiated template covers
  corrupt_data,      // malformed file contents
  io_error,
  cuda_error,
};

constexpr const char* to_string(StatusCode c) {
  switch (c) {
    case StatusCode::ok: return "ok";
    case StatusCode::invalid_argument: return "invalid_argument";
    case StatusCode::out_of_range: return "out_of_range";
    case StatusCode::unsupported: return "unsupported";
    case StatusCode::corrupt_data: return "corrupt_data";
    case StatusCode::io_error: return "io_error";
    case StatusCode::cuda_error: return "cuda_error";
  }
  return "unknown";
}

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  bool ok() const { return code_ == StatusCode::ok; }
  explicit operator bool() const { return ok(); }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  std::string to_string() const {
    return ok() ? "ok" : std::string(kvq::to_string(code_)) + ": " + message_;
  }

 private:
  StatusCode code_ = StatusCode::ok;
  std::string message_;
};

class Error : public std::runtime_error {
 public:
  explicit Error(const Status& s) : std::runtime_error(s.to_string()), code_(s.code()) {}
  Error(StatusCode c, const std::string& msg) : Error(Status(c, msg)) {}
  StatusCode code() const { return code_; }

 private:
  StatusCode code_;
};

// Throws kvq::Error when `s` is not ok.
inline void throw_if_error(const Status& s) {
  if (!s.ok()) throw Error(s);
}

}  // namespace kvq

// Early return of a non-ok Status from a function that returns Status.
#define KVQ_RETURN_IF_ERROR(expr)            \
  do {                                       \
    ::kvq::Status kvq_status_ = (expr);      \
    if (!kvq_status_.ok()) return kvq_status_; \
  } while (0)

// Returns Status(code, msg) from the enclosing function unless `cond` holds.
#define KVQ_CHECK_ARG(cond, code, msg)                     \
  do {                                                     \
    if (!(cond)) return ::kvq::Status((code), (msg));      \
  } while (0)
