// engine: the request a scheduler moves between queues, with its tokens and block table.
#include "engine/request.h"

namespace fantai::engine {

// Names match the OpenAI / vLLM finish_reason strings the server returns.
const char* finish_reason_name(FinishReason r) {
  switch (r) {
    case FinishReason::kNone: return "";
    case FinishReason::kStop: return "stop";
    case FinishReason::kLength: return "length";
    case FinishReason::kAbort: return "abort";
  }
  return "";
}

}  // namespace fantai::engine
