// common: logging sink.
#include "common/logging.h"

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <mutex>

namespace fantai {
namespace {

LogLevel initial_level() {
  const char* env = std::getenv("FANTAI_LOG_LEVEL");
  if (!env) return LogLevel::kInfo;
  if (!std::strcmp(env, "debug")) return LogLevel::kDebug;
  if (!std::strcmp(env, "warning")) return LogLevel::kWarning;
  if (!std::strcmp(env, "error")) return LogLevel::kError;
  if (!std::strcmp(env, "off")) return LogLevel::kOff;
  return LogLevel::kInfo;
}

std::atomic<int> g_level{static_cast<int>(initial_level())};
std::mutex g_mutex;

}  // namespace

LogLevel log_level() { return static_cast<LogLevel>(g_level.load(std::memory_order_relaxed)); }
void set_log_level(LogLevel level) { g_level.store(static_cast<int>(level)); }

void log_message(LogLevel level, const std::string& msg) {
  static const char* names[] = {"DEBUG", "INFO", "WARNING", "ERROR", "OFF"};
  std::lock_guard<std::mutex> lock(g_mutex);
  std::cerr << "[fantai " << names[static_cast<int>(level)] << "] " << msg << std::endl;
}

}  // namespace fantai
