// shardsafe/torch/device_copy.hpp - copies between host memory and LibTorch tensors on a device
// (CUDA): the staging ring's engine for loads (checkpoint/staged_load.hpp), and the copies out
// of device tensors that a save fetches while it writes (save_options::fetch).
//
// device_copy_engine is the ring's CopyEngine for one device: its slots are pinned host memory
// (pinned_host_bytes), its copies are host-to-device copies queued on a stream of its own
// (taken from LibTorch's pool for the device, so the training's streams are not held up), and
// its fences are device events recorded on that stream. It uses only LibTorch's device-generic
// interfaces (c10::Stream, c10::Event, the device guard): nothing here needs CUDA's headers or
// a CUDA build of LibTorch to compile, and any device LibTorch has a stream pool for works.
//
// load_state_dict (torch/state_dict.hpp) sends every contiguous tensor that is not on the CPU
// here, grouped by device; host memory is the ring's (device_load_options::staging) whatever the
// model's size. save_state_dict fetches such tensors' bytes with copy_from_device, in the
// writer's blocks, from the writer threads: the device-to-host copies of some blocks run while
// others are written, and host memory is the writer's blocks.
#pragma once

#include <ATen/ATen.h>
#include <c10/core/Device.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <cstdint>
#include <memory>
#include <span>

#include "shardsafe/checkpoint/staged_load.hpp"
#include "shardsafe/torch/compat.hpp"
#include "shardsafe/torch/tensor_memory.hpp"

namespace shardsafe {

/// CopyEngine (checkpoint/staged_load.hpp) from pinned host memory to one LibTorch device.
class device_copy_engine {
 public:
  using target = std::byte*;  ///< an address in the device's memory
  using fence = c10::Event;

  explicit device_copy_engine(c10::Device device)
      : device_(device), stream_(c10::impl::VirtualGuardImpl(device.type()).getStreamFromGlobalPool(device)) {
    // copies start after the work queued so far on the device's current stream (a training
    // step may still read the tensors being loaded into)
    c10::Event queued(device_.type());
    queued.record(c10::impl::VirtualGuardImpl(device_.type()).getStream(device_));
    queued.block(stream_);
  }

  c10::Device device() const noexcept { return device_; }
  c10::Stream stream() const noexcept { return stream_; }

  std::shared_ptr<std::byte> allocate(std::uint64_t n) { return pinned_host_bytes(n); }

  /// Queues src -> dst + off on the engine's stream.
  void copy(std::byte* dst, std::uint64_t off, std::span<const std::byte> src) {
    if (src.empty()) return;
    const std::int64_t n = static_cast<std::int64_t>(src.size());
    c10::StreamGuard guard(stream_);
    at::Tensor to = at::from_blob(dst + off, {n}, at::TensorOptions().dtype(at::kByte).device(device_));
    at::Tensor from = at::from_blob(const_cast<std::byte*>(src.data()), {n}, at::TensorOptions().dtype(at::kByte));
    to.copy_(from, /*non_blocking=*/true);
  }
  fence record() {
    c10::Event e(device_.type());
    e.record(stream_);
    return e;
  }
  void wait(const fence& f) { compat::synchronize_event(f); }
  void synchronize() { stream_.synchronize(); }

 private:
  c10::Device device_;
  c10::Stream stream_;
};
static_assert(CopyEngine<device_copy_engine>);

/// Waits for the work queued so far on the device's current stream (before a save reads
/// tensors that a training step may still be writing).
inline void wait_for_queued_work(c10::Device device) {
  c10::impl::VirtualGuardImpl(device.type()).getStream(device).synchronize();
}

/// Copies bytes [off, off + dst.size()) of a contiguous device tensor's memory into host memory
/// dst and waits for them; on a stream from the device's pool, so that several threads copy
/// at once.
inline void copy_from_device(const at::Tensor& t, std::uint64_t off, std::span<std::byte> dst) {
  if (dst.empty()) return;
  const c10::Device device = t.device();
  const std::int64_t n = static_cast<std::int64_t>(dst.size());
  c10::StreamGuard guard(c10::impl::VirtualGuardImpl(device.type()).getStreamFromGlobalPool(device));
  at::Tensor from = at::from_blob(static_cast<std::byte*>(t.data_ptr()) + off, {n},
                                  at::TensorOptions().dtype(at::kByte).device(device));
  at::Tensor to = at::from_blob(dst.data(), {n}, at::TensorOptions().dtype(at::kByte));
  to.copy_(from);  // synchronous: returns once the bytes are in dst
}

}  // namespace shardsafe
