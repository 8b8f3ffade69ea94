// A decode session's hand-off between its running generation loop and the host that picks its
// tokens (terra/decoding/decode_session.py). The loop's custom calls post a step's logits and wait
// for the next token; the host's calls (through ctypes, which releases Python's lock while they
// wait) post a token and wait for the logits. One mutex and condition variable per session: no
// Python runs on XLA's threads, and nothing is converted to or from Python arrays.

#include <algorithm>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <vector>

#include "host_registry.h"
#include "xla/ffi/api/ffi.h"

namespace terra::native {

namespace ffi = xla::ffi;

namespace {

struct Exchange {
  std::mutex mutex;
  std::condition_variable changed;
  int64_t batch = 0, vocab = 0;
  std::vector<int32_t> token;
  std::vector<float> logits;
  bool token_posted = false, logits_posted = false, stop = false, ended = false;
};

std::shared_ptr<Exchange> Find(int32_t id) { return HostRegistry<Exchange>::Get().Find(id); }

// The loop's side: waits for the host's next token (or its stop) and writes it out.
ffi::Error AwaitToken(Exchange& e, std::unique_lock<std::mutex>& lock, ffi::Result<ffi::Buffer<ffi::S32>>& token,
                      ffi::Result<ffi::Buffer<ffi::PRED>>& stop) {
  if (static_cast<int64_t>(token->element_count()) != e.batch)
    return ffi::Error::InvalidArgument("session exchange: the token has another batch than the session");
  e.changed.wait(lock, [&] { return e.token_posted || e.stop; });
  bool* stop_out = stop->typed_data();
  *stop_out = e.stop;
  if (e.token_posted) std::memcpy(token->typed_data(), e.token.data(), e.batch * sizeof(int32_t));
  else std::fill(token->typed_data(), token->typed_data() + e.batch, 0);
  e.token_posted = false;
  return ffi::Error::Success();
}

// session s32[] -> (token s32[batch], stop pred[]): the first token.
ffi::Error FirstTokenImpl(ffi::Buffer<ffi::S32> session, ffi::Result<ffi::Buffer<ffi::S32>> token,
                          ffi::Result<ffi::Buffer<ffi::PRED>> stop) {
  std::shared_ptr<Exchange> e = Find(*session.typed_data());
  if (!e) return ffi::Error::InvalidArgument("session exchange: no such session");
  std::unique_lock<std::mutex> lock(e->mutex);
  return AwaitToken(*e, lock, token, stop);
}

// (session s32[], logits f32[batch, vocab]) -> (token s32[batch], stop pred[]): posts a step's
// logits, then waits for the next token.
ffi::Error HandOverImpl(ffi::Buffer<ffi::S32> session, ffi::Buffer<ffi::F32> logits,
                        ffi::Result<ffi::Buffer<ffi::S32>> token, ffi::Result<ffi::Buffer<ffi::PRED>> stop) {
  std::shared_ptr<Exchange> e = Find(*session.typed_data());
  if (!e) return ffi::Error::InvalidArgument("session exchange: no such session");
  if (static_cast<int64_t>(logits.element_count()) != e->batch * e->vocab)
    return ffi::Error::InvalidArgument("session exchange: the logits are not [batch, vocab] of the session");
  {
    std::unique_lock<std::mutex> lock(e->mutex);
    std::memcpy(e->logits.data(), logits.typed_data(), e->logits.size() * sizeof(float));
    e->logits_posted = true;
    e->changed.notify_all();
    return AwaitToken(*e, lock, token, stop);
  }
}

}  // namespace

#pragma GCC visibility push(default)

XLA_FFI_DEFINE_HANDLER_SYMBOL(terra_session_first_token, FirstTokenImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::PRED>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(terra_session_hand_over, HandOverImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::PRED>>());

// The host's side. Opens session `id` for `batch` rows of `vocab` logits; 1 if the id is taken.
extern "C" int terra_session_open(int32_t id, int64_t batch, int64_t vocab) {
  auto e = std::make_shared<Exchange>();
  e->batch = batch, e->vocab = vocab;
  e->token.resize(batch), e->logits.resize(batch * vocab);
  return HostRegistry<Exchange>::Get().Add(id, std::move(e)) ? 0 : 1;
}

// Posts `token` [batch] and waits for the step's logits, written to `logits` [batch, vocab].
// Returns 0, or 1 when the loop has ended (failed) or the session is unknown.
extern "C" int terra_session_step(int32_t id, const int32_t* token, float* logits) {
  std::shared_ptr<Exchange> e = Find(id);
  if (!e) return 1;
  std::unique_lock<std::mutex> lock(e->mutex);
  std::memcpy(e->token.data(), token, e->batch * sizeof(int32_t));
  e->token_posted = true;
  e->changed.notify_all();
  e->changed.wait(lock, [&] { return e->logits_posted || e->ended; });
  if (!e->logits_posted) return 1;
  std::memcpy(logits, e->logits.data(), e->logits.size() * sizeof(float));
  e->logits_posted = false;
  return 0;
}

// Tells the loop to stop at its next wait for a token.
extern "C" void terra_session_stop(int32_t id) {
  std::shared_ptr<Exchange> e = Find(id);
  if (!e) return;
  std::lock_guard<std::mutex> lock(e->mutex);
  e->stop = true;
  e->changed.notify_all();
}

// The loop has returned or failed: wakes a host waiting for logits, and forgets the session.
extern "C" void terra_session_end(int32_t id) {
  std::shared_ptr<Exchange> e = HostRegistry<Exchange>::Get().Remove(id);
  if (!e) return;
  std::lock_guard<std::mutex> lock(e->mutex);
  e->ended = true;
  e->changed.notify_all();
}

#pragma GCC visibility pop

}  // namespace terra::native
