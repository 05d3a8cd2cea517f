// common: checks that turn broken invariants and bad input into exceptions (never aborts).
#pragma once

#include <sstream>
#include <stdexcept>

namespace fantai {

// Thrown for bad input from a caller (maps to ValueError in Python, 400 on the server).
class InvalidArgument : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

}  // namespace fantai

#define FANTAI_THROW(msg)                               \
  do {                                                  \
    std::ostringstream fantai_oss_;                     \
    fantai_oss_ << msg;                                 \
    throw ::fantai::InvalidArgument(fantai_oss_.str()); \
  } while (0)

#define FANTAI_CHECK(cond, msg)                                                      \
  do {                                                                               \
    if (!(cond)) {                                                                   \
      std::ostringstream fantai_oss_;                                                \
      fantai_oss_ << msg << " [" #cond " at " << __FILE__ << ":" << __LINE__ << "]"; \
      throw std::runtime_error(fantai_oss_.str());                                   \
    }                                                                                \
  } while (0)

// For caller-supplied values: throws InvalidArgument with a plain message.
#define FANTAI_REQUIRE(cond, msg)   \
  do {                              \
    if (!(cond)) FANTAI_THROW(msg); \
  } while (0)
