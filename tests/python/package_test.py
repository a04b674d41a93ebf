"""The package's pure-Python parts against a fake of its compiled module (no build needed).

The package's sources (python/modelavg) are loaded with ``modelavg._core`` replaced by a fake
that records what it is asked and answers what a test tells it. Checked: connect()'s and the job
calls' keyword options (the table is the binding's, not a copy: an option only the fake's table
has is taken and passed on), the environment (what the binding's parser reads, completed by the
keywords, which win), the exceptions made from a status (kind and blamed rank as attributes,
never read from the message), and the job spec the job calls send.

  pytest tests/python/package_test.py
"""

import datetime
from dataclasses import replace as dataclasses_replace
import importlib.util
import os
import sys
import types

import pytest

PACKAGE_DIR = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "python",
                                           "modelavg"))

# The binding's table (python/messages.cc) as a fake has it, plus one option the package has
# never heard of.
OPTIONS = {
    "auth_token": ("str", True), "auth_token_file": ("str", True), "tls": ("bool", True),
    "tls_ca_file": ("str", True), "tls_cert_file": ("str", True), "tls_key_file": ("str", True),
    "rpc_timeout": ("duration", True), "worker_id": ("str", False),
    "join_timeout": ("duration", False), "schedule_window": ("int", False),
    "gloo_in_place": ("bool", False), "tokens_per_step": ("float", False),
    "brand_new_option": ("str", False),
}


class FakeCore(types.ModuleType):
    """modelavg._core: records every call; `environment` is what its parser "reads"."""

    def __init__(self):
        super().__init__("modelavg._core")
        self.OPTIONS = OPTIONS
        self.environment = {}
        self.calls = []

        class Decision:
            pass

        class Client:
            rank, world_size, generation, job_id = 0, 1, 1, "job"

        self.Decision = Decision
        self.Client = Client
        self.Averager = object

    # The binding's payload table (include/modelavg/common/payload.h) as a fake has it: the
    # names, and the fields' check, which the package asks rather than repeating.
    PAYLOADS = ("FP32", "BF16", "INT8", "INT4", "TOPK")

    def payload_names(self):
        return self.PAYLOADS

    def check_payload(self, where, payload, topk_density, error_feedback):
        if payload not in self.PAYLOADS:
            return f"{where}: payload={payload!r}: expected one of {', '.join(self.PAYLOADS)}"
        return ""

    def connection_from_environment(self):
        return dict(self.environment)

    def tokens_per_step_from_environment(self):
        # The binding parses and checks MODELAVG_TOKENS_PER_STEP (C++); the fake only records.
        self.calls.append(("tokens_per_step_from_environment",
                           os.environ["MODELAVG_TOKENS_PER_STEP"]))
        return float(os.environ["MODELAVG_TOKENS_PER_STEP"])

    def connect(self, options):
        self.calls.append(("connect", dict(options)))
        return self.Client()

    def create_job(self, conn, spec):
        self.calls.append(("create_job", dict(conn), dict(spec)))
        return job_dict(spec)

    def get_job(self, conn, job_id):
        self.calls.append(("get_job", dict(conn), job_id))
        return job_dict({"job_id": job_id, "world_size": 2, "mode": "PERIODIC",
                         "levels": [(4, 2)], "outer": [None],
                         "streaming": [(1, 0, 0.0, "FP32", 0.0, 0.0)],
                         "warmup_steps": 0, "heartbeat_timeout_ms": 0, "join_timeout_ms": 0,
                         "min_world_size": 0, "replica_size": 0})

    def update_job(self, conn, job_id, spec):
        self.calls.append(("update_job", dict(conn), job_id, dict(spec)))
        return {"switch_step": 120, "plan_version": 1, "job": job_dict(spec)}


def job_dict(spec):
    """A job record as the binding returns it (python/messages.cc JobDict)."""
    return {"spec": dict(spec), "state": "PENDING", "generation": 1, "members": [],
            "min_step": 0, "max_step": 0, "warnings": [], "created_unix_ms": 0,
            "last_change": None, "live_world_size": 0, "vacant_ranks": [], "deaths": 0,
            "admissions": 0, "waiting_ranks": []}


@pytest.fixture
def package():
    """(modelavg loaded from python/modelavg over a FakeCore, the fake). Whatever modelavg this
    process had before (the build's, for the other tests) is put back afterwards."""
    saved = {k: v for k, v in sys.modules.items() if k == "modelavg" or k.startswith("modelavg.")}
    for k in saved:
        del sys.modules[k]
    fake = FakeCore()
    sys.modules["modelavg._core"] = fake
    try:
        spec = importlib.util.spec_from_file_location(
            "modelavg", os.path.join(PACKAGE_DIR, "__init__.py"),
            submodule_search_locations=[PACKAGE_DIR])
        module = importlib.util.module_from_spec(spec)
        sys.modules["modelavg"] = module
        spec.loader.exec_module(module)
        yield module, fake
    finally:
        for k in [k for k in sys.modules if k == "modelavg" or k.startswith("modelavg.")]:
            del sys.modules[k]
        sys.modules.update(saved)


def test_connect_OptionsOfTheBindingsTable_CheckedAndPassedOn(package):
    modelavg, fake = package
    modelavg.connect("c:1", "job", rank=2, join_timeout=datetime.timedelta(seconds=1.5),
                     schedule_window=8, gloo_in_place=True, brand_new_option="x")
    (_, opts), = fake.calls
    assert opts == {"coordinator": "c:1", "job_id": "job", "rank": 2, "join_timeout": 1.5,
                    "schedule_window": 8, "gloo_in_place": True, "brand_new_option": "x"}


def test_connect_UnknownOrMistypedOption_ErrorNamingIt(package):
    modelavg, fake = package
    with pytest.raises(TypeError, match="unknown option 'heartbeat_stream'.*brand_new_option"):
        modelavg.connect("c:1", "job", heartbeat_stream=False)  # not in the fake's table
    with pytest.raises(modelavg.InvalidArgumentError, match="schedule_window='8'"):
        modelavg.connect("c:1", "job", schedule_window="8")
    with pytest.raises(modelavg.InvalidArgumentError, match="join_timeout=-1"):
        modelavg.connect("c:1", "job", join_timeout=-1)
    with pytest.raises(modelavg.InvalidArgumentError, match="tls=1"):
        modelavg.connect("c:1", "job", tls=1)
    assert fake.calls == []


def test_connect_Environment_CompletesTheKeywordsWhichWin(package, monkeypatch):
    modelavg, fake = package
    fake.environment = {"coordinator": "env:1", "auth_token_file": "/env-token",
                        "tls": True, "tls_ca_file": "/ca.pem", "rpc_timeout": 2.5}
    monkeypatch.delenv("RANK", raising=False)
    modelavg.connect(job_id="job")
    modelavg.connect("kw:1", "job", auth_token="kw-token", rpc_timeout=4)
    (_, from_env), (_, from_kw) = fake.calls
    assert from_env == {"coordinator": "env:1", "job_id": "job", "auth_token_file": "/env-token",
                        "tls": True, "tls_ca_file": "/ca.pem", "rpc_timeout": 2.5}
    # A token from the keywords replaces the environment's token file (never both).
    assert from_kw == {"coordinator": "kw:1", "job_id": "job", "auth_token": "kw-token",
                       "tls": True, "tls_ca_file": "/ca.pem", "rpc_timeout": 4.0}


def test_connect_NoCoordinatorAnywhere_InvalidArgumentNamingTheVariable(package):
    modelavg, fake = package
    with pytest.raises(modelavg.InvalidArgumentError, match="MODELAVG_COORDINATOR"):
        modelavg.connect(job_id="job")
    assert fake.calls == []


def test_connect_RankFromTheEnvironment_UsedUnlessGiven(package, monkeypatch):
    modelavg, fake = package
    monkeypatch.setenv("RANK", "3")
    modelavg.connect("c:1", "job")
    modelavg.connect("c:1", "job", rank=1)
    assert [c[1]["rank"] for c in fake.calls] == [3, 1]
    monkeypatch.setenv("RANK", "three")
    with pytest.raises(modelavg.InvalidArgumentError, match="RANK='three'"):
        modelavg.connect("c:1", "job")


def test_connect_TokensPerStep_ANumberPassedOnAsFloat(package, monkeypatch):
    modelavg, fake = package
    monkeypatch.delenv("MODELAVG_TOKENS_PER_STEP", raising=False)
    modelavg.connect("c:1", "job", tokens_per_step=2048)
    modelavg.connect("c:1", "job", tokens_per_step=0.5)
    modelavg.connect("c:1", "job")
    assert [c[1].get("tokens_per_step") for c in fake.calls] == [2048.0, 0.5, None]
    assert isinstance(fake.calls[0][1]["tokens_per_step"], float)
    for bad in ("8", True, [1]):
        with pytest.raises(modelavg.InvalidArgumentError, match="tokens_per_step="):
            modelavg.connect("c:1", "job", tokens_per_step=bad)


def test_connect_TokensPerStep_FromTheEnvironmentUnlessGiven(package, monkeypatch):
    modelavg, fake = package
    monkeypatch.setenv("MODELAVG_TOKENS_PER_STEP", "512")
    modelavg.connect("c:1", "job")
    modelavg.connect("c:1", "job", tokens_per_step=3)
    (_, env), (_, from_env), (_, from_kw) = fake.calls
    assert env == "512"
    assert from_env["tokens_per_step"] == 512.0
    assert from_kw["tokens_per_step"] == 3.0


def test_jobCalls_TakeOnlyTheConnectionOptions(package):
    modelavg, fake = package
    fake.environment = {"auth_token_file": "/env-token"}
    modelavg.get_job("j", coordinator="c:1", rpc_timeout=3, tls=False)
    (_, conn, job_id), = fake.calls
    assert (conn, job_id) == ({"coordinator": "c:1", "rpc_timeout": 3.0, "tls": False,
                               "auth_token_file": "/env-token"}, "j")
    with pytest.raises(TypeError, match="unknown option 'join_timeout'"):
        modelavg.get_job("j", coordinator="c:1", join_timeout=3)


def test_createJob_Levels_SentAsTheBindingsSpec(package):
    modelavg, fake = package
    sgd = modelavg.OuterSGD(0.7, momentum=0.9, nesterov=True)
    job = modelavg.create_job(
        "j", 4, "hierarchical", [(2, 2), modelavg.Level(8, 4, outer=sgd, fragments=2)],
        warmup_steps=3, min_world_size=3, replica_size=1, coordinator="c:1")
    (_, conn, spec), = fake.calls
    assert conn == {"coordinator": "c:1"}
    assert spec == {"job_id": "j", "world_size": 4, "mode": "HIERARCHICAL",
                    "levels": [(2, 2), (8, 4)], "outer": [None, (0.7, 0.9, True)],
                    "streaming": [(1, 0, 0.0, "FP32", 0.0, 0.0), (2, 0, 0.0, "FP32", 0.0, 0.0)],
                    "warmup_steps": 3, "heartbeat_timeout_ms": 0, "join_timeout_ms": 0,
                    "min_world_size": 3, "replica_size": 1}
    assert job.spec.job_id == "j" and job.state == "PENDING" and job.spec.replica_size == 1
    with pytest.raises(modelavg.InvalidArgumentError, match="levels or period, not both"):
        modelavg.create_job("j", 4, "PERIODIC", [(2, 4)], period=2, coordinator="c:1")
    with pytest.raises(modelavg.InvalidArgumentError, match="expected a \\(period, group_size\\)"):
        modelavg.create_job("j", 4, "PERIODIC", [2], coordinator="c:1")


def test_createJob_PacedLevel_SentUnderPacing_ReadBack(package):
    """Level(paced=True, max_lag=..., rounds=...) goes to the binding as "pacing" (paced,
    max_lag, rounds) per level, and a job record's pacing comes back on its Level
    (docs/paced.md)."""
    modelavg, fake = package
    job = modelavg.create_job(
        "j", 4, "HIERARCHICAL",
        [(2, 2), modelavg.Level(8, 4, paced=True, max_lag=3, rounds=50)],
        min_world_size=2, coordinator="c:1")
    (_, _, spec), = fake.calls
    assert spec["pacing"] == [(False, 0.0, 0), (True, 3.0, 50)]
    assert spec["levels"] == [(2, 2), (8, 4)]
    assert job.spec.levels[1] == modelavg.Level(8, 4, paced=True, max_lag=3.0, rounds=50)
    assert job.spec.levels[1].pacing and not job.spec.levels[1].streaming


def test_createJob_NoPacedLevel_NoPacingKey(package):
    """A spec without pacing is sent as before the fields existed."""
    modelavg, fake = package
    modelavg.create_job("j", 4, "PERIODIC", [modelavg.Level(8, 4, fragments=2)],
                        coordinator="c:1")
    (_, _, spec), = fake.calls
    assert "pacing" not in spec


@pytest.mark.parametrize("fields, says", [
    ({"paced": 1}, "paced=1: expected True or False"),
    ({"paced": True, "max_lag": 0.5}, "max_lag=0.5: expected 0"),
    ({"paced": True, "max_lag": 2e6}, "in \\[1, 1e6\\]"),
    ({"paced": True, "max_lag": float("nan")}, "max_lag=nan"),
    ({"paced": True, "max_lag": True}, "max_lag=True"),
    ({"max_lag": 3}, "max_lag=3.0 needs paced=True"),
    ({"rounds": 5}, "rounds=5 needs paced=True"),
    ({"paced": True, "rounds": -1}, "rounds=-1: expected an integer"),
    ({"paced": True, "rounds": 1.5}, "rounds=1.5: expected an integer"),
])
def test_level_BadPacing_InvalidArgumentNamingTheField(package, fields, says):
    modelavg, _ = package
    with pytest.raises(modelavg.InvalidArgumentError, match=says):
        modelavg.Level(8, 4, **fields)


def test_updateJob_Fields_TheLatestPlanWithThemChanged(package):
    modelavg, fake = package
    update = modelavg.update_job("j", period=8, heartbeat_timeout_ms=5000, coordinator="c:1")
    (get, _, _), (name, conn, job_id, spec) = fake.calls
    assert (get, name, conn, job_id) == ("get_job", "update_job", {"coordinator": "c:1"}, "j")
    # get_job's plan (the fake's: PERIODIC, world 2, period 4) with the period and timeout.
    assert spec == {"job_id": "j", "world_size": 2, "mode": "PERIODIC", "levels": [(8, 2)],
                    "outer": [None], "streaming": [(1, 0, 0.0, "FP32", 0.0, 0.0)],
                    "warmup_steps": 0, "heartbeat_timeout_ms": 5000, "join_timeout_ms": 0,
                    "min_world_size": 0, "replica_size": 0}
    assert (update.switch_step, update.plan_version) == (120, 1)
    assert update.job.spec.levels == [(8, 2)] and update.job.plan_history == []


def test_updateJob_WholeSpec_SentAsGivenWithTheJobsId(package):
    modelavg, fake = package
    sgd = modelavg.OuterSGD(0.35, momentum=0.9)
    spec = modelavg.JobSpec(job_id="", world_size=4, mode="HIERARCHICAL",
                            levels=[(2, 2), modelavg.Level(6, 4, outer=sgd)])
    modelavg.update_job("j", spec, coordinator="c:1")
    (name, _, job_id, sent), = fake.calls
    assert (name, job_id, sent["job_id"]) == ("update_job", "j", "j")
    assert sent["levels"] == [(2, 2), (6, 4)] and sent["outer"] == [None, (0.35, 0.9, False)]


def test_updateJob_BadArguments_InvalidArgumentNamingThem(package):
    modelavg, fake = package
    spec = modelavg.JobSpec(job_id="other", world_size=2, mode="PERIODIC", levels=[(4, 2)])
    with pytest.raises(modelavg.InvalidArgumentError, match="'other' is not 'j'"):
        modelavg.update_job("j", spec, coordinator="c:1")
    with pytest.raises(modelavg.InvalidArgumentError, match="not both"):
        modelavg.update_job("j", dataclasses_replace(spec, job_id="j"), period=8,
                            coordinator="c:1")
    with pytest.raises(modelavg.InvalidArgumentError, match="nothing to change"):
        modelavg.update_job("j", coordinator="c:1")
    with pytest.raises(modelavg.InvalidArgumentError, match="levels or period, not both"):
        modelavg.update_job("j", levels=[(8, 2)], period=8, coordinator="c:1")
    assert fake.calls == []


@pytest.mark.parametrize("code,averaging,cls,bases", [
    (9, True, "PeerFailureError", ()),           # FAILED_PRECONDITION in an averaging step
    (14, True, "PeerFailureError", ()),          # UNAVAILABLE in an averaging step
    (14, False, "UnavailableError", (ConnectionError,)),
    (5, False, "NotFoundError", (LookupError,)),
    (3, True, "InvalidArgumentError", (ValueError,)),
    (16, False, "PermissionDeniedError", (PermissionError,)),
    (13, False, "Error", ()),
])
def test_fromStatus_CodeAndPlace_TheirClass(package, code, averaging, cls, bases):
    modelavg, _ = package
    e = modelavg.errors._from_status(code, "what happened", averaging)
    assert type(e) is getattr(modelavg, cls)
    assert isinstance(e, bases) if bases else True
    assert (e.kind, e.rank, e.message) == (None, None, "what happened")


def test_fromStatus_KindAndRank_AttributesNotTheMessage(package):
    modelavg, _ = package
    e = modelavg.errors._from_status(9, "job j moved to generation 3 because rank 7 died", True,
                                     "GENERATION_MOVED", 2)
    assert isinstance(e, modelavg.PeerFailureError)
    assert (e.code, e.kind, e.rank) == ("FAILED_PRECONDITION", "GENERATION_MOVED", 2)
    # No rank given: none, whatever the message says.
    e = modelavg.errors._from_status(9, "job j moved because rank 7 died", True, "PEER_FAILURE")
    assert (e.kind, e.rank) == ("PEER_FAILURE", None)
    assert str(e) == "FAILED_PRECONDITION: job j moved because rank 7 died"


def test_fromStatus_NonFiniteKind_NonFiniteErrorAValueError(package):
    modelavg, _ = package
    e = modelavg.errors._from_status(3, "member 2 of this subgroup contributed non-finite values",
                                     True, "NON_FINITE", 5)
    assert type(e) is modelavg.NonFiniteError
    assert isinstance(e, modelavg.InvalidArgumentError) and isinstance(e, ValueError)
    assert (e.code, e.kind, e.rank) == ("INVALID_ARGUMENT", "NON_FINITE", 5)
    # Where it was: set by the binding from the error's detail; None until then.
    assert (e.step, e.level, e.tensor, e.value) == (None, None, None, None)


@pytest.mark.parametrize("averaging", [True, False])
def test_fromStatus_ReplicaLostKind_ReplicaLostErrorWithRankAndReplica(package, averaging):
    modelavg, _ = package
    message = ("averaging at step 12: replica 1 (ranks 2..3) of job j was retired because its "
               "rank 3 died or failed: rank 2 cannot average a partial replica")
    e = modelavg.errors._from_status(9, message, averaging, "REPLICA_LOST", 3)
    # The kind picks the class, in an averaging call or not; the rank comes from the status.
    assert type(e) is modelavg.ReplicaLostError
    assert isinstance(e, modelavg.PeerFailureError)
    assert (e.code, e.kind, e.rank, e.replica) == ("FAILED_PRECONDITION", "REPLICA_LOST", 3, 1)
    assert e.message == message
