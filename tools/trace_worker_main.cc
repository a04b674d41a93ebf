// modelavg-trace-worker, as shipped: the synthetic conformance worker (tools/trace_worker.cc)
// on the build's own communicators.
#include "tools/trace_worker.h"

int main(int argc, char** argv) { return modelavg::TraceWorkerMain(argc, argv, nullptr); }
