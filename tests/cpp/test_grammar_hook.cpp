// tests/cpp: GrammarHook — masks computed on the worker thread, joined before sampling.
#include "engine/grammar_hook.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <stdexcept>
#include <thread>

namespace fantai::engine {
namespace {

// Allows token (request id + number of tokens seen so far) in each row; records the thread.
class CountingProvider : public TokenMaskProvider {
 public:
  void fill(const std::vector<MaskRow>& rows, uint32_t* masks, int32_t words) override {
    thread = std::this_thread::get_id();
    std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms));
    // Held until the test lets go: a fill that ran inside begin() would wait out the 10 s.
    if (hold) {
      const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
      while (!released.load() && std::chrono::steady_clock::now() < until)
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      held_to_the_end = !released.load();
    }
    if (fail) throw std::runtime_error("grammar broke");
    for (size_t i = 0; i < rows.size(); ++i) {
      const int32_t t = static_cast<int32_t>(rows[i].request_id) + rows[i].num_fed +
                        static_cast<int32_t>(rows[i].new_tokens.size());
      masks[i * words + t / 32] |= 1u << (t % 32);
    }
    ++calls;
  }
  std::thread::id thread;
  std::atomic<int> calls{0};
  int delay_ms = 0;
  bool fail = false;
  bool hold = false;
  std::atomic<bool> released{false};
  bool held_to_the_end = false;
};

TEST(GrammarHook, FillsMasksOnItsOwnThread) {
  auto provider = std::make_shared<CountingProvider>();
  provider->hold = true;
  GrammarHook hook(provider, 70);  // 3 words
  EXPECT_EQ(hook.words(), 3);
  std::vector<MaskRow> rows(2);
  rows[0].request_id = 3;
  rows[1].request_id = 40;
  rows[1].num_fed = 20;
  rows[1].new_tokens = {1, 2};
  hook.begin(rows);
  // begin() returns before the provider finishes (the forward pass overlaps it): the provider
  // is still held here. Not a time bound, which a loaded machine (CI under ASan) can miss.
  provider->released = true;
  const uint32_t* masks = hook.wait();
  EXPECT_FALSE(provider->held_to_the_end);
  EXPECT_NE(provider->thread, std::this_thread::get_id());
  EXPECT_EQ(masks[0], 1u << 3);
  EXPECT_EQ(masks[1], 0u);
  EXPECT_EQ(masks[3 + 62 / 32], 1u << (62 % 32));  // 40 + 20 + 2
  hook.begin({});  // a step with no rows still hands over (and clears) the buffer
  hook.wait();
  EXPECT_EQ(provider->calls.load(), 2);
}

TEST(GrammarHook, RethrowsTheProvidersErrorAndRecovers) {
  auto provider = std::make_shared<CountingProvider>();
  GrammarHook hook(provider, 32);
  provider->fail = true;
  hook.begin(std::vector<MaskRow>(1));
  EXPECT_THROW(hook.wait(), std::runtime_error);
  provider->fail = false;
  hook.begin(std::vector<MaskRow>(1));
  EXPECT_EQ(hook.wait()[0], 1u);
}

TEST(GrammarHook, BeginWaitsForAnAbandonedJob) {
  auto provider = std::make_shared<CountingProvider>();
  provider->delay_ms = 10;
  GrammarHook hook(provider, 32);
  hook.begin(std::vector<MaskRow>(1));  // a step that threw before wait()
  hook.begin(std::vector<MaskRow>(2));
  hook.wait();
  EXPECT_EQ(provider->calls.load(), 2);
}  // the destructor joins a job still running

}  // namespace
}  // namespace fantai::engine
