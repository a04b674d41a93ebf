# modelavg-bench-gpu: the NCCL path on one GPU (world 1): averaging next to a raw
# ncclAllReduce(ncclAvg), and the gather/scatter kernels' bandwidth. Built whenever CUDA is
# found; it needs a device to run.
if(MODELAVG_HAVE_CUDA AND TARGET modelavg_server)
  add_executable(modelavg-bench-gpu gpu_bench.cc)
  target_link_libraries(modelavg-bench-gpu PRIVATE modelavg_client modelavg_server modelavg::nccl
                        absl::flags absl::flags_parse)
endif()
