#!/usr/bin/python3
"""Drives modelavg-coordinator the way grpcurl does: over server reflection only.

No modelavg .proto file and no generated modelavg code: the only compiled proto is gRPC's own
reflection.proto (Debian's grpc-proto). Every modelavg message type comes from the descriptors
the server sends back. Lists services, describes modelavg.v1.Coordinator, creates a job and
reads its schedule (one rank and every subgroup), with token auth on.

    /usr/bin/python3 server_reflection_test.py --coordinator=PATH/modelavg-coordinator
"""
import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import unittest

import grpc
from google.protobuf import descriptor_pb2
from google.protobuf import descriptor_pool
from google.protobuf import json_format
from google.protobuf import message_factory

REFLECTION_PROTO = "/usr/share/grpc-proto/grpc/reflection/v1alpha/reflection.proto"
TOKEN = "reflection-test-token"
COORDINATOR = None  # set from the command line


def compile_reflection_proto(out_dir):
    """Generates Python code for gRPC's reflection service (not for anything of modelavg)."""
    from grpc_tools import protoc  # python3-grpc-tools

    src = os.path.join(out_dir, "reflection.proto")  # outside the `grpc` package namespace
    shutil.copy(REFLECTION_PROTO, src)
    rc = protoc.main(["protoc", "-I" + out_dir, "--python_out=" + out_dir,
                      "--grpc_python_out=" + out_dir, src])
    if rc != 0:
        raise RuntimeError("protoc failed on reflection.proto")
    sys.path.insert(0, out_dir)
    import reflection_pb2
    import reflection_pb2_grpc
    return reflection_pb2, reflection_pb2_grpc


def message_class(pool, name):
    desc = pool.FindMessageTypeByName(name)
    if hasattr(message_factory, "GetMessageClass"):
        return message_factory.GetMessageClass(desc)
    return message_factory.MessageFactory(pool).GetPrototype(desc)


class ReflectionTest(unittest.TestCase):
    """Each test has a coordinator of its own, so the tests hold in any order (the reverse
    order runs as its own ctest entry)."""

    @classmethod
    def setUpClass(cls):
        cls.class_tmp = tempfile.mkdtemp(prefix="modelavg-reflection-")
        cls.pb2, cls.pb2_grpc = compile_reflection_proto(cls.class_tmp)

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.class_tmp, ignore_errors=True)

    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="coordinator-", dir=self.class_tmp)
        token_file = os.path.join(self.tmp, "token")
        with open(token_file, "w") as f:
            f.write(TOKEN + "\n")
        port_file = os.path.join(self.tmp, "port")
        self.log = open(os.path.join(self.tmp, "coordinator.log"), "w")
        self.proc = subprocess.Popen(
            [COORDINATOR, "--listen=127.0.0.1:0", "--port_file=" + port_file,
             "--auth_token_file=" + token_file],
            stderr=self.log, start_new_session=True)
        self.addCleanup(self.stop_coordinator)
        deadline = time.time() + 30
        while not os.path.exists(port_file):
            if self.proc.poll() is not None or time.time() > deadline:
                raise RuntimeError("the coordinator did not start")
            time.sleep(0.02)
        with open(port_file) as f:
            self.address = f.read().strip()
        self.channel = grpc.insecure_channel(self.address)
        self.addCleanup(self.channel.close)
        self.pool = descriptor_pool.DescriptorPool()
        self.loaded_files = set()

    def stop_coordinator(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()

    # --- the reflection client -------------------------------------------------------------

    def reflect(self, **request):
        stub = self.pb2_grpc.ServerReflectionStub(self.channel)
        responses = list(stub.ServerReflectionInfo(
            iter([self.pb2.ServerReflectionRequest(**request)]), timeout=20))
        self.assertEqual(len(responses), 1)
        response = responses[0]
        self.assertNotEqual(response.WhichOneof("message_response"), "error_response",
                            response.error_response.error_message)
        return response

    def load_symbol(self, symbol):
        """Adds the file defining `symbol` (and its imports) to the pool, like grpcurl."""
        response = self.reflect(file_containing_symbol=symbol)
        files = [descriptor_pb2.FileDescriptorProto.FromString(b)
                 for b in response.file_descriptor_response.file_descriptor_proto]
        pending = {f.name: f for f in files}

        def add(name):
            if name in self.loaded_files:
                return
            if name not in pending:
                by_name = self.reflect(file_by_filename=name)
                for b in by_name.file_descriptor_response.file_descriptor_proto:
                    f = descriptor_pb2.FileDescriptorProto.FromString(b)
                    pending.setdefault(f.name, f)
            proto = pending[name]
            for dep in proto.dependency:
                add(dep)
            self.pool.Add(proto)
            self.loaded_files.add(name)

        for f in files:
            add(f.name)

    def call(self, method, request_json, token=TOKEN):
        """Unary call with request and reply types taken from the reflected descriptors."""
        self.load_symbol("modelavg.v1.Coordinator")
        service = self.pool.FindServiceByName("modelavg.v1.Coordinator")
        m = service.methods_by_name[method]
        request_cls = message_class(self.pool, m.input_type.full_name)
        reply_cls = message_class(self.pool, m.output_type.full_name)
        request = json_format.Parse(request_json, request_cls())
        rpc = self.channel.unary_unary("/modelavg.v1.Coordinator/" + method,
                                       request_serializer=lambda r: r.SerializeToString(),
                                       response_deserializer=reply_cls.FromString)
        metadata = [("authorization", "Bearer " + token)] if token else None
        reply = rpc(request, timeout=20, metadata=metadata)
        return json_format.MessageToDict(reply, preserving_proto_field_name=True)

    # --- the tests ---------------------------------------------------------------------------

    def test_1_list_services(self):
        services = {s.name for s in self.reflect(list_services="").list_services_response.service}
        self.assertIn("modelavg.v1.Coordinator", services)
        self.assertIn("grpc.health.v1.Health", services)
        self.assertIn("grpc.reflection.v1alpha.ServerReflection", services)

    def test_2_describe_coordinator(self):
        self.load_symbol("modelavg.v1.Coordinator")
        service = self.pool.FindServiceByName("modelavg.v1.Coordinator")
        methods = set(service.methods_by_name)
        for name in ("CreateJob", "GetJob", "ListJobs", "DeleteJob", "Join", "Heartbeat", "Step",
                     "GetSchedule", "PublishCommId", "GetCommId", "Leave", "WatchJob", "Ping",
                     "HeartbeatStream", "UpdateJob"):
            self.assertIn(name, methods)
        get_schedule = service.methods_by_name["GetSchedule"]
        self.assertEqual(get_schedule.input_type.full_name, "modelavg.v1.GetScheduleRequest")
        fields = set(get_schedule.input_type.fields_by_name)
        self.assertEqual(fields, {"job_id", "from_step", "count", "rank", "plans_known",
                                  "credential"})
        decision = self.pool.FindMessageTypeByName("modelavg.v1.StepDecision")
        for name in ("step", "action", "level", "period", "subgroup", "ranks", "generation",
                     "plan"):
            self.assertIn(name, decision.fields_by_name)

    def test_3_create_job_and_read_schedule(self):
        created = self.call("CreateJob", """{"spec": {"job_id": "refl", "world_size": 4,
            "mode": "HIERARCHICAL", "levels": [{"period": 2, "group_size": 2},
                                              {"period": 4, "group_size": 4}]}}""")
        self.assertEqual(created["state"], "PENDING")
        self.assertEqual(created["generation"], "1")  # int64 as a JSON string

        one = self.call("GetSchedule",
                        '{"job_id": "refl", "from_step": 0, "count": 5, "rank": 3}')
        actions = [(d["step"] if "step" in d else "0", d["action"], d.get("ranks", []))
                   for d in one["decisions"]]
        self.assertEqual(actions, [
            ("0", "AVERAGE", [0, 1, 2, 3]), ("1", "SKIP", []), ("2", "AVERAGE", [2, 3]),
            ("3", "SKIP", []), ("4", "AVERAGE", [0, 1, 2, 3])])

        everyone = self.call("GetSchedule", '{"job_id": "refl", "from_step": 2, "count": 1}')
        self.assertEqual([d["ranks"] for d in everyone["decisions"]], [[0, 1], [2, 3]])

        job = self.call("GetJob", '{"job_id": "refl"}')
        self.assertEqual(job["spec"]["world_size"], 4)
        listed = self.call("ListJobs", "{}")
        self.assertIn("refl", [j["spec"]["job_id"] for j in listed["jobs"]])

    def test_4_errors_and_auth(self):
        self.call("CreateJob", """{"spec": {"job_id": "refl", "world_size": 2,
            "mode": "PERIODIC", "levels": [{"period": 1, "group_size": 2}]}}""")
        with self.assertRaises(grpc.RpcError) as bad:
            self.call("GetSchedule", '{"job_id": "refl", "count": 0}')
        self.assertEqual(bad.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)
        with self.assertRaises(grpc.RpcError) as unknown:
            self.call("GetJob", '{"job_id": "nope"}')
        self.assertEqual(unknown.exception.code(), grpc.StatusCode.NOT_FOUND)
        with self.assertRaises(grpc.RpcError) as refused:
            self.call("ListJobs", "{}", token=None)
        self.assertEqual(refused.exception.code(), grpc.StatusCode.UNAUTHENTICATED)

    def test_5_sigterm_exits_zero(self):
        self.proc.send_signal(signal.SIGTERM)
        self.assertEqual(self.proc.wait(timeout=30), 0)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--coordinator", required=True)
    parser.add_argument("--reverse", action="store_true",
                        help="run the tests in reverse order (they must not depend on it)")
    args, rest = parser.parse_known_args()
    COORDINATOR = args.coordinator
    if args.reverse and not rest:
        names = sorted(n for n in dir(ReflectionTest) if n.startswith("test_"))
        rest = [f"ReflectionTest.{n}" for n in reversed(names)]
    unittest.main(argv=[sys.argv[0]] + rest, verbosity=2)
