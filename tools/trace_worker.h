// modelavg-trace-worker's program (tools/trace_worker.cc), for its two mains: the shipped
// program (tools/trace_worker_main.cc), which runs on the build's own communicators, and the
// tests' variant (tests/tools/trace_worker_faults_main.cc, not installed), which also takes
// --testing_fail_commit_at_step and wraps the communicators in a fake from tests/testing/. The
// shipped program links no test code.
#ifndef MODELAVG_TOOLS_TRACE_WORKER_H_
#define MODELAVG_TOOLS_TRACE_WORKER_H_

#include <functional>
#include <memory>
#include <string>

#include "modelavg/client/client.h"

namespace modelavg {

// The communicators the worker's client is given, from the Gloo address it binds to; an empty
// function or a null result: the build's own (Client::Connect without a factory).
using TraceWorkerCommunicators =
    std::function<std::unique_ptr<client::CommunicatorFactory>(const std::string& gloo_hostname)>;

// Parses the flags, runs the worker and returns the process's exit code (the header comment of
// tools/trace_worker.cc says what it does and prints).
int TraceWorkerMain(int argc, char** argv, const TraceWorkerCommunicators& make_communicators);

}  // namespace modelavg

#endif  // MODELAVG_TOOLS_TRACE_WORKER_H_
