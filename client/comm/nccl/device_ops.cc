#include "client/comm/nccl/device_ops.h"

#include "common/status_util.h"

namespace modelavg::client {

absl::Status GrowableBuffer::Reserve(DeviceOps& ops, size_t bytes, bool* grown) {
  if (grown != nullptr) *grown = false;
  if (bytes <= capacity_ && data_ != nullptr) return absl::OkStatus();
  Release(ops);
  void* p = nullptr;
  absl::Status s = pinned_host_ ? ops.MallocHost(&p, bytes) : ops.Malloc(&p, bytes);
  if (!s.ok()) return s;
  data_ = p;
  capacity_ = bytes;
  if (grown != nullptr) *grown = true;
  return absl::OkStatus();
}

void GrowableBuffer::Release(DeviceOps& ops) {
  if (data_ != nullptr) {
    if (pinned_host_) {
      ops.FreeHost(data_);
    } else {
      ops.Free(data_);
    }
  }
  data_ = nullptr;
  capacity_ = 0;
}

absl::Status UploadChunkTable(DeviceOps& ops, const std::vector<StagingChunk>& chunks,
                              std::vector<StagingChunk>* host, GrowableBuffer* device,
                              void* stream) {
  host->clear();
  MODELAVG_RETURN_IF_ERROR(device->Reserve(ops, chunks.size() * sizeof(StagingChunk)));
  *host = chunks;
  absl::Status s =
      ops.Copy(device->data(), host->data(), host->size() * sizeof(StagingChunk), stream);
  if (!s.ok()) host->clear();
  return s;
}

}  // namespace modelavg::client
