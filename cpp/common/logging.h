// common: minimal leveled logging to stderr (the engine logs pool sizes and preemptions).
#pragma once

#include <iostream>
#include <sstream>

namespace fantai {

enum class LogLevel { kDebug = 0, kInfo = 1, kWarning = 2, kError = 3, kOff = 4 };
LogLevel log_level();
void set_log_level(LogLevel level);
void log_message(LogLevel level, const std::string& msg);

}  // namespace fantai

#define FANTAI_LOG(level, msg)                                                 \
  do {                                                                         \
    if (::fantai::LogLevel::level >= ::fantai::log_level()) {                  \
      std::ostringstream fantai_log_oss_;                                      \
      fantai_log_oss_ << msg;                                                  \
      ::fantai::log_message(::fantai::LogLevel::level, fantai_log_oss_.str()); \
    }                                                                          \
  } while (0)
