// A generation loop's tokens handed to the host as it chooses them (terra/decoding/streaming.py).
// The loop's custom call appends a step's tokens to the stream and returns at once with whether
// the host asked it to stop: the loop never waits for Python. The host's side (through ctypes,
// which releases Python's lock while it waits) takes the steps in order on a thread of its own.
// One mutex and condition variable per stream; nothing runs Python on XLA's threads.

#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <vector>

#include "host_registry.h"
#include "xla/ffi/api/ffi.h"

namespace terra::native {

namespace ffi = xla::ffi;

namespace {

struct TokenStream {
  std::mutex mutex;
  std::condition_variable changed;
  int64_t batch = 0;
  std::deque<std::pair<int32_t, std::vector<int32_t>>> pending;  // (step, tokens [batch])
  bool stop = false, ended = false;
};

std::shared_ptr<TokenStream> FindStream(int32_t id) { return HostRegistry<TokenStream>::Get().Find(id); }

// (stream s32[], step s32[], tokens s32[batch]) -> stop pred[]: appends the step's tokens; stop
// is true once the host asked for it, or when the stream is not open (nobody would read it).
ffi::Error PushImpl(ffi::Buffer<ffi::S32> stream, ffi::Buffer<ffi::S32> step, ffi::Buffer<ffi::S32> tokens,
                    ffi::Result<ffi::Buffer<ffi::PRED>> stop) {
  std::shared_ptr<TokenStream> s = FindStream(*stream.typed_data());
  bool* stop_out = stop->typed_data();
  if (!s) {
    *stop_out = true;
    return ffi::Error::Success();
  }
  if (static_cast<int64_t>(tokens.element_count()) != s->batch)
    return ffi::Error::InvalidArgument("token stream: the tokens have another batch than the stream");
  std::lock_guard<std::mutex> lock(s->mutex);
  s->pending.emplace_back(*step.typed_data(),
                          std::vector<int32_t>(tokens.typed_data(), tokens.typed_data() + s->batch));
  *stop_out = s->stop;
  s->changed.notify_all();
  return ffi::Error::Success();
}

}  // namespace

#pragma GCC visibility push(default)

XLA_FFI_DEFINE_HANDLER_SYMBOL(terra_stream_push, PushImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::PRED>>());

// The host's side. Opens stream `id` for `batch` rows; 1 if the id is taken.
extern "C" int terra_stream_open(int32_t id, int64_t batch) {
  auto s = std::make_shared<TokenStream>();
  s->batch = batch;
  return HostRegistry<TokenStream>::Get().Add(id, std::move(s)) ? 0 : 1;
}

// Waits for the stream's next step: writes its number to `step` and its tokens to `tokens`
// [batch] and returns 0, or returns 1 once the loop has ended and every step was taken.
extern "C" int terra_stream_next(int32_t id, int32_t* step, int32_t* tokens) {
  std::shared_ptr<TokenStream> s = FindStream(id);
  if (!s) return 1;
  std::unique_lock<std::mutex> lock(s->mutex);
  s->changed.wait(lock, [&] { return !s->pending.empty() || s->ended; });
  if (s->pending.empty()) return 1;
  *step = s->pending.front().first;
  std::memcpy(tokens, s->pending.front().second.data(), s->batch * sizeof(int32_t));
  s->pending.pop_front();
  return 0;
}

// Asks the loop to stop: its next push returns true.
extern "C" void terra_stream_stop(int32_t id) {
  std::shared_ptr<TokenStream> s = FindStream(id);
  if (!s) return;
  std::lock_guard<std::mutex> lock(s->mutex);
  s->stop = true;
}

// The loop has returned or failed: the reader takes what is left, then `terra_stream_next` returns 1.
extern "C" void terra_stream_end(int32_t id) {
  std::shared_ptr<TokenStream> s = FindStream(id);
  if (!s) return;
  std::lock_guard<std::mutex> lock(s->mutex);
  s->ended = true;
  s->changed.notify_all();
}

// Forgets the stream (after its reader is done).
extern "C" void terra_stream_close(int32_t id) { HostRegistry<TokenStream>::Get().Remove(id); }

#pragma GCC visibility pop

}  // namespace terra::native
