"""Which failures end a run, on real exception objects: the same-step rule compares root causes
(DCP's CheckpointException unwrapped) and where in the attempt; a transient error or a peer's loss
never repeats "the same way"; attempts that end without a new checkpoint stop the run, naming the step."""

from __future__ import annotations

import pytest
from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

from rayllm.errors import RayllmError, StorageUnavailable
from rayllm.runtime.control import RunControl, failure_record
from rayllm.runtime.failure_policy import failure_message, is_fatal


def raised(error: BaseException) -> BaseException:
    try:
        raise error
    except BaseException as e:
        return e


def dcp_error(*per_rank: BaseException) -> CheckpointException:
    return raised(CheckpointException("load", {r: _wrap_exception(raised(e)) for r, e in enumerate(per_rank)}))


def test_two_root_causes_inside_dcps_exception_are_not_the_same_failure():
    control = RunControl()
    first = dcp_error(FileNotFoundError("checkpoint_00000004/__0_0.distcp"))
    second = dcp_error(RuntimeError("size mismatch for model.tok_embeddings.weight"))
    assert "CheckpointException ranks:dict_keys" in str(first)  # what the old rule compared
    assert control.begin_attempt().attempt == 1
    assert not control.record_failure(1, failure_record(first, 0, in_loop=False))
    control.begin_attempt()
    record = failure_record(second, 0, in_loop=False)
    assert not control.record_failure(2, record)
    assert record.cause == "RuntimeError: size mismatch for model.tok_embeddings.weight"  # named, unwrapped
    control.begin_attempt()
    assert control.record_failure(
        3, failure_record(dcp_error(RuntimeError("size mismatch for model.tok_embeddings.weight")), 0, False)
    )


def test_a_failure_while_starting_is_not_the_same_as_one_in_a_step():
    control = RunControl()
    error = ValueError("injected deterministic failure in step 3")
    control.begin_attempt()
    assert not control.record_failure(1, failure_record(raised(error), 2, in_loop=True))  # in step 3
    control.begin_attempt()  # resumed from step 2: fails before its first step, at the resume step
    assert not control.record_failure(2, failure_record(raised(ValueError(str(error))), 2, in_loop=False))
    control.begin_attempt()
    again = failure_record(raised(ValueError(str(error))), 2, in_loop=True)
    assert control.record_failure(3, again) and again.where == "at step 2"


def test_transient_errors_and_a_peers_loss_never_repeat_the_same_way():
    control = RunControl()
    outage = raised(StorageUnavailable("reading shard s3://b/x: storage did not answer for 180 s"))
    peer = raised(RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:5678"))
    reset = dcp_error(ConnectionResetError(104, "Connection reset by peer"), ConnectionResetError(104, "reset"))
    for attempt in (1, 2, 3):
        control.begin_attempt()
        for error in (outage, peer, reset):
            assert not control.record_failure(attempt, failure_record(error, 5, in_loop=True))
    assert not is_fatal(outage) and not is_fatal(reset)


def test_attempts_that_end_without_a_new_checkpoint_stop_the_run_naming_the_step():
    control = RunControl()
    start = control.begin_attempt(3)
    control.progress(start.attempt, 4, start=True)
    control.progress(start.attempt, 6, committed=True)
    control.progress(start.attempt, 7)  # then killed (SIGKILL: nothing recorded)
    for _ in range(3):
        start = control.begin_attempt(3)
        assert start.stop is None
        control.progress(start.attempt, 6, start=True)
        control.progress(start.attempt, 7)
    stop = control.begin_attempt(3).stop
    assert stop.startswith("3 attempts in a row ended without a new checkpoint, each at step 7")
    assert "no error was recorded: the process was killed" in stop
    assert "cluster.max_attempts_without_progress" in stop


def test_an_outage_or_a_commit_is_not_a_crash_loop():
    control = RunControl()
    for attempt in range(1, 6):
        start = control.begin_attempt(2)
        assert start.stop is None, start.stop
        if attempt % 2:  # a storage outage ended it: retried, not counted
            control.record_failure(attempt, failure_record(raised(StorageUnavailable("down")), 3, True))
        else:
            control.progress(attempt, 3, committed=True)
    assert control.begin_attempt(None).stop is None


def test_the_run_ends_with_the_named_cause():
    error = raised(RayllmError("2 attempts in a row ended without a new checkpoint, each at step 7"))
    assert is_fatal(error)
    assert failure_message(error).startswith("2 attempts in a row")


@pytest.mark.parametrize("key", ["storage.retry_deadline_s=0", "cluster.max_attempts_without_progress=0"])
def test_out_of_range_keys_are_refused(key):
    from rayllm import ConfigError, TrainConfig

    with pytest.raises(ConfigError, match=key.split("=")[0]):
        TrainConfig.from_yaml("configs/tiny.yaml", overrides=[key])


def test_a_run_that_runs_out_of_restarts_names_the_root_cause_in_one_line():
    from ray.train.v2.api.exceptions import WorkerGroupError

    outage = raised(StorageUnavailable("reading shard s3://b/x: storage did not answer for 90 s"))
    error = WorkerGroupError("Traceback (most recent call last): ...", {0: outage, 1: outage})
    assert not is_fatal(error)
    assert failure_message(error) == "StorageUnavailable: reading shard s3://b/x: storage did not answer for 90 s"


def test_an_outage_in_ray_trains_controller_restarts_the_attempt_up_to_max_failures():
    from ray.train import FailureConfig
    from ray.train.v2._internal.execution.failure_handling import FailureDecision
    from ray.train.v2.api.exceptions import ControllerError

    from rayllm.runtime.failure_policy import RayllmFailurePolicy

    policy = RayllmFailurePolicy(FailureConfig(max_failures=2))
    outage = ControllerError(raised(StorageUnavailable("pipe_file run/checkpoint_manager_snapshot.json: ...")))
    assert [policy.make_decision(outage) for _ in range(3)] == [
        FailureDecision.RETRY,
        FailureDecision.RETRY,
        FailureDecision.RAISE,
    ]
    assert policy.make_decision(ControllerError(raised(KeyError("a bug")))) == FailureDecision.RAISE


def test_attempts_ended_to_grow_or_by_a_controller_outage_are_not_a_crash_loop():
    """A cluster scaling up from empty restarts the run at each arrival, often before any commit;
    an outage in Ray Train's controller ends an attempt that no rank saw fail."""
    control = RunControl()
    for world_size in (1, 2, 3, 4):  # each ended, before its first commit, by a node's arrival
        assert control.begin_attempt(2, world_size).stop is None
    control.attempt_hit_outage()
    assert control.begin_attempt(2, 4).stop is None
    control.attempt_hit_outage()
    assert control.begin_attempt(2, 4).stop is None
    assert control.begin_attempt(2, 4).stop is None  # one stalled: the one just before
    stop = control.begin_attempt(2, 4).stop  # two in a row at the same size: a crash loop
    assert stop is not None and stop.startswith("2 attempts in a row")


def test_a_rank_stopped_after_checkpointing_is_a_preemption_not_a_failure():
    """SIGTERM or a node's interruption notice: the run checkpointed and the attempt ended on
    purpose; charged to Ray Train's preemption budget (unbounded), not to cluster.max_failures."""
    from ray.train import FailureConfig
    from ray.train.v2._internal.execution.failure_handling import FailureDecision
    from ray.train.v2.api.exceptions import WorkerGroupError

    from rayllm.errors import WorkerPreempted
    from rayllm.runtime.failure_policy import RayllmFailurePolicy, is_preemption

    preempted = raised(WorkerPreempted("rank 1 was asked to stop; checkpointed at step 9"))
    collateral = raised(RuntimeError("Connection closed by peer"))
    error = WorkerGroupError("Traceback ...", {0: collateral, 1: preempted})
    assert is_preemption(error) and not is_fatal(error)
    policy = RayllmFailurePolicy(FailureConfig(max_failures=0))
    assert [policy.make_decision(error) for _ in range(5)] == [FailureDecision.RETRY] * 5
    crash = WorkerGroupError("Traceback ...", {0: collateral, 1: raised(RuntimeError("CUDA error"))})
    assert not is_preemption(crash) and policy.make_decision(crash) == FailureDecision.RAISE
    bounded = RayllmFailurePolicy(FailureConfig(max_failures=-1, max_preemption_failures=1))
    assert [bounded.make_decision(error) for _ in range(2)] == [FailureDecision.RETRY, FailureDecision.RAISE]
