"""The job config: defaults, TOML job file, TF_CONFIG and flags, their precedence, and the errors they raise."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import pytest

from ps_common import jobconfig, settings_doc
from ps_common.jobconfig import JobConfig, JobConfigError
from ps_server.cli import server_config

REPO = Path(__file__).resolve().parents[2]

TF_PS_1 = json.dumps({"cluster": {"ps": ["ps-0.job:2222", "ps-1.job:2223"], "chief": ["chief-0:2222"],
                                  "worker": ["worker-0:2222", "worker-1:2222"]},
                      "task": {"type": "ps", "index": 1}})


def load(argv: list[str], *, scope: str, env: dict[str, str] | None = None) -> JobConfig:
    parser = argparse.ArgumentParser()
    jobconfig.add_arguments(parser, scope=scope)
    return jobconfig.load_config(parser.parse_args(argv), scope=scope, env=env or {})


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "job.toml"
    path.write_text(text)
    return str(path)


def test_defaults_give_the_server_config_defaults() -> None:
    config = server_config(load([], scope="server"))
    assert (config.mode, config.num_shards, config.shard_index, config.host, config.port) == \
        ("async", 1, 0, "127.0.0.1", 0)
    assert (config.replicas_to_aggregate, config.total_replicas, config.optimizer) == (1, 1, "sgd")
    assert config.optimizer_params == {"lr": 0.01}
    assert config.wait_timeout_seconds == 300.0 and config.lease_seconds == 10.0


def test_a_job_file_sets_every_section(tmp_path: Path) -> None:
    path = write(tmp_path, """
[job]
mode = "sync"
workers = 3
shards = 2
replicas_to_aggregate = 2
[server]
optimizer = "adam"
lr = 0.003
checkpoint_dir = "/ckpt"
[server.optimizer_params]
amsgrad = true
[worker]
model = "lenet"
batch_size = 16
epochs = 2
[launch]
record = "runs/x"
""")
    config = load(["--config", path], scope="launch")
    assert (config.job.mode, config.job.workers, config.job.shards, config.job.replicas_to_aggregate) == \
        ("sync", 3, 2, 2)
    assert config.optimizer_hyperparameters() == {"lr": 0.003, "amsgrad": True}
    assert (config.server.checkpoint_dir, config.worker.model, config.worker.batch_size) == ("/ckpt", "lenet", 16)
    assert config.worker.epochs == 2 and config.worker.steps is None
    assert config.launch.record == "runs/x"
    assert config.source("worker.batch_size") == path


def test_flags_override_the_job_file(tmp_path: Path) -> None:
    path = write(tmp_path, '[job]\nmode = "sync"\n[server]\nlr = 0.5\n[server.optimizer_params]\nmomentum = 0.5\n')
    config = load(["--config", path, "--lr", "0.1", "--opt", "momentum=0.9", "--opt", "nesterov=true"],
                  scope="server")
    assert config.job.mode == "sync"
    assert config.optimizer_hyperparameters() == {"lr": 0.1, "momentum": 0.9, "nesterov": True}
    assert config.source("server.lr") == "--lr"


def test_tf_config_overrides_the_job_file_and_flags_override_tf_config(tmp_path: Path) -> None:
    path = write(tmp_path, "[job]\nshards = 5\n[server]\nport = 9999\n")
    config = load(["--config", path], scope="server", env={"TF_CONFIG": TF_PS_1})
    assert (config.job.shards, config.server.port, config.server.shard_index) == (2, 2223, 1)
    config = load(["--config", path, "--port", "7000"], scope="server", env={"TF_CONFIG": TF_PS_1})
    assert config.server.port == 7000 and config.source("server.port") == "--port"


def test_tf_config_ps_task_binds_all_interfaces_for_a_remote_host() -> None:
    config = load([], scope="server", env={"TF_CONFIG": TF_PS_1})
    server = server_config(config)
    assert (server.host, server.port, server.shard_index, server.num_shards) == ("0.0.0.0", 2223, 1, 2)
    assert server.total_replicas == 3   # chief + 2 workers


@pytest.mark.parametrize("host", ["localhost", "127.0.0.1", "127.0.0.2"])
def test_tf_config_ps_task_keeps_a_loopback_host(host: str) -> None:
    tf = json.dumps({"cluster": {"ps": [f"{host}:2222"]}, "task": {"type": "ps", "index": 0}})
    assert load([], scope="server", env={"TF_CONFIG": tf}).server.host == host


def test_tf_config_worker_tasks_count_the_chief_as_worker_zero() -> None:
    tf = json.loads(TF_PS_1)
    tf["task"] = {"type": "worker", "index": 1}
    config = load([], scope="worker", env={"TF_CONFIG": json.dumps(tf)})
    assert (config.worker.index, config.job.workers, config.job.shards) == (2, 3, 2)
    assert config.worker.servers == ["ps-0.job:2222", "ps-1.job:2223"]
    assert config.worker.worker_id == "worker2"
    tf["task"] = {"type": "chief", "index": 0}
    assert load([], scope="worker", env={"TF_CONFIG": json.dumps(tf)}).worker.index == 0


def test_tf_config_replicated_shards_give_each_ps_task_its_replica_and_every_voter() -> None:
    cluster = {"ps": ["ps-0a.job:2222|ps-0b.job:2222", "ps-1a.job:2222|ps-1b.job:2222"], "worker": ["w:1"]}
    tf = json.dumps({"cluster": cluster, "task": {"type": "ps", "index": 1, "replica": 1}})
    config = load([], scope="server", env={"TF_CONFIG": tf})
    assert (config.server.shard_index, config.server.replica_index, config.job.shards) == (1, 1, 2)
    assert config.server.replicas == ["ps-1a.job:2222", "ps-1b.job:2222"] and config.server.port == 2222
    assert config.server.voters == ["ps-0a.job:2222", "ps-0b.job:2222", "ps-1a.job:2222", "ps-1b.job:2222"]
    worker = json.dumps({"cluster": cluster, "task": {"type": "worker", "index": 0}})
    assert load([], scope="worker", env={"TF_CONFIG": worker}).worker.servers == cluster["ps"]


def test_tf_config_is_ignored_by_the_launcher() -> None:
    assert load([], scope="launch", env={"TF_CONFIG": "not json"}).job.shards == 1


@pytest.mark.parametrize("tf, scope, fragment", [
    ("{not json", "server", "TF_CONFIG is not valid JSON"),
    ('{"cluster": {"ps": ["a:1"]}, "task": {"type": "worker", "index": 0}}', "server", "task.type 'worker'"),
    ('{"cluster": {"ps": ["a:1"]}, "task": {"type": "ps", "index": 3}}', "server", "task.index 3 is out of range"),
    ('{"cluster": {"ps": ["a:1"], "evaluator": ["e:1"]}, "task": {"type": "evaluator", "index": 0}}', "worker",
     "task.type is 'evaluator'"),
    ('{"cluster": {"ps": ["a"]}, "task": {"type": "ps", "index": 0}}', "server", "address 'a' is not host:port"),
    ('{"cluster": {"worker": ["w:1"]}, "task": {"type": "worker", "index": 0}}', "worker", "no cluster.ps"),
    ('{"cluster": {"ps": ["a:1|b:1"]}, "task": {"type": "ps", "index": 0, "replica": 2}}', "server",
     "task.replica 2 is out of range"),
    ('{"cluster": {"ps": ["a:1|b:1"]}, "task": {"type": "ps", "index": 0, "replica": 1}}', "server",
     "needs at least 3"),
    ('{"cluster": {"ps": ["a:1|b:1"]}, "task": {"type": "ps", "index": 0, "replica": -1}}', "server",
     "task.replica must be an integer"),
])
def test_bad_tf_config_errors_name_the_part_and_value(tf: str, scope: str, fragment: str) -> None:
    with pytest.raises(JobConfigError, match="TF_CONFIG|address") as info:
        load([], scope=scope, env={"TF_CONFIG": tf})
    assert fragment in str(info.value)


def test_unknown_job_file_key_is_named_with_the_known_keys(tmp_path: Path) -> None:
    path = write(tmp_path, "[worker]\nbatchsize = 3\n")
    with pytest.raises(JobConfigError, match=r"\[worker\] batchsize is not a setting; the \[worker\] keys are .*batch_size"):
        load(["--config", path], scope="worker")


def test_a_job_file_that_is_not_utf8_is_named_with_the_byte(tmp_path: Path) -> None:
    path = tmp_path / "binary.toml"
    path.write_bytes(b"\xff\xfe[job]\n")
    with pytest.raises(JobConfigError, match=r"job file '.*binary.toml' is not UTF-8 text \(byte 0xff at position 0\)"):
        load(["--config", str(path)], scope="worker")


def test_unknown_job_file_table_is_named(tmp_path: Path) -> None:
    with pytest.raises(JobConfigError, match=r"unknown table \[trainer\]"):
        load(["--config", write(tmp_path, "[trainer]\nx = 1\n")], scope="worker")


def test_per_process_settings_are_refused_in_a_job_file(tmp_path: Path) -> None:
    with pytest.raises(JobConfigError, match=r"\[server\] shard_index is set per process"):
        load(["--config", write(tmp_path, "[server]\nshard_index = 1\n")], scope="server")


def test_wrong_type_in_the_job_file_names_key_and_value(tmp_path: Path) -> None:
    path = write(tmp_path, '[worker]\nbatch_size = "32"\n')
    with pytest.raises(JobConfigError, match=r"\[worker\] batch_size = '32': expected an integer"):
        load(["--config", path], scope="worker")


def test_invalid_toml_names_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, "[job\nmode = 1\n")
    with pytest.raises(JobConfigError, match="is not valid TOML"):
        load(["--config", path], scope="server")


def test_missing_job_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(JobConfigError, match="does not exist"):
        load(["--config", str(tmp_path / "nope.toml")], scope="server")


def test_out_of_range_values_name_the_setting_the_value_and_its_source(tmp_path: Path) -> None:
    with pytest.raises(JobConfigError, match=r"\[worker\] batch_size \(--batch-size\): 0 \(from --batch-size\): "
                                             r"must be >= 1"):
        load(["--batch-size", "0"], scope="launch")
    path = write(tmp_path, '[job]\nmode = "bsp"\n')
    with pytest.raises(JobConfigError, match=rf"\[job\] mode \(--mode\): 'bsp' \(from {path}\): choose one of sync"):
        load(["--config", path], scope="launch")


def test_more_replicas_than_workers_is_an_error() -> None:
    with pytest.raises(JobConfigError, match=r"replicas_to_aggregate.*: 3 .*must be <= workers \(2, from --workers\)"):
        load(["--workers", "2", "--replicas-to-aggregate", "3"], scope="launch")


def test_replicas_alone_set_the_worker_count_as_before() -> None:
    config = server_config(load(["--mode", "sync", "--replicas-to-aggregate", "2"], scope="server"))
    assert (config.replicas_to_aggregate, config.total_replicas) == (2, 2)
    config = server_config(load(["--mode", "sync", "--replicas-to-aggregate", "2", "--total-replicas", "3"],
                                scope="server"))
    assert (config.replicas_to_aggregate, config.total_replicas) == (2, 3)


def test_staleness_accepts_inf_from_flags_and_toml(tmp_path: Path) -> None:
    assert math.isinf(load(["--mode", "ssp", "--staleness", "inf"], scope="server").job.staleness)
    assert math.isinf(load(["--config", write(tmp_path, "[job]\nmode = \"ssp\"\nstaleness = inf\n")],
                           scope="server").job.staleness)
    with pytest.raises(JobConfigError, match="whole number or inf"):
        load(["--mode", "ssp", "--staleness", "1.5"], scope="server")


@pytest.mark.parametrize("flags, mode, needs", [
    (["--staleness", "3"], "sync", "ssp"), (["--staleness", "inf"], "async", "ssp"),
    (["--max-staleness", "2"], "sync", "async"), (["--max-staleness", "2"], "ssp", "async")])
def test_a_bound_of_another_mode_is_refused_naming_the_mode(flags, mode, needs) -> None:
    with pytest.raises(JobConfigError) as refused:
        load(["--mode", mode, *flags], scope="server")
    assert f"applies only in mode {needs}, and this job's mode is {mode} (from --mode): drop it, or use --mode " \
           f"{needs}" in str(refused.value)
    assert str(refused.value).startswith(f"Invalid [job] {flags[0][2:].replace('-', '_')} ({flags[0]})")


def test_a_bound_at_its_default_is_taken_in_any_mode(tmp_path: Path) -> None:
    """A job file written for every mode may spell the defaults out."""
    config = load(["--config", write(tmp_path, "[job]\nmode = \"sync\"\nstaleness = 0\nmax_staleness = 0\n")],
                  scope="server")
    assert (config.job.staleness, config.job.max_staleness) == (0, 0)


def test_worker_needs_as_many_servers_as_shards() -> None:
    with pytest.raises(JobConfigError, match=r"servers.*a worker needs the shards' addresses"):
        load([], scope="worker")
    config = load(["--servers", "a:1,b:2"], scope="worker")
    assert config.job.shards == 2
    with pytest.raises(JobConfigError, match=r"2 addresses for shards = 3 \(from --shards\)"):
        load(["--servers", "a:1,b:2", "--shards", "3"], scope="worker")


def test_steps_default_only_when_epochs_is_unset() -> None:
    assert load([], scope="launch").worker.steps == jobconfig.DEFAULT_STEPS
    config = load(["--epochs", "2"], scope="launch")
    assert (config.worker.steps, config.worker.epochs) == (None, 2)


def test_flag_parse_errors_name_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        load(["--batch-size", "many"], scope="worker")
    assert "--batch-size: expected an integer, got 'many'" in capsys.readouterr().err


def test_commands_take_only_their_flags() -> None:
    with pytest.raises(SystemExit):
        load(["--servers", "a:1"], scope="server")
    with pytest.raises(SystemExit):
        load(["--shard-index", "1"], scope="launch")


def test_log_level_is_case_insensitive() -> None:
    assert load(["--log-level", "debug"], scope="server").job.log_level == "DEBUG"


def test_to_argv_reproduces_the_settings_in_a_child_command(tmp_path: Path) -> None:
    path = write(tmp_path, '[job]\nmode = "ssp"\nstaleness = inf\nworkers = 2\n[server]\noptimizer = "momentum"\n'
                           '[server.optimizer_params]\nnesterov = true\n[worker]\nbatch_size = 8\nepochs = 3\n')
    parent = load(["--config", path, "--lr", "0.2", "--log-json"], scope="launch")
    child = load(jobconfig.to_argv(parent, scope="server"), scope="server")
    assert server_config(child) == server_config(parent)
    worker = load([*jobconfig.to_argv(parent, scope="worker"), "--servers", "h:1"], scope="worker")
    for name in ("job.mode", "job.staleness", "job.workers", "worker.batch_size", "worker.epochs",
                 "worker.steps", "job.log_json"):
        assert worker.get(name) == parent.get(name), name


def test_every_setting_has_a_flag_help_and_scope() -> None:
    flags: dict[str, set[str]] = {}
    for info in jobconfig.iter_settings():
        assert info.flags and info.help and info.scopes, info.name
        for scope in info.scopes:
            for flag in info.flags:
                assert flag not in flags.setdefault(scope, set()), f"{flag} twice in {scope}"
                flags[scope].add(flag)


def test_settings_doc_is_up_to_date() -> None:
    doc = REPO / "docs" / "settings.md"
    assert settings_doc.documented_block(doc) == settings_doc.settings_markdown(), \
        "docs/settings.md is stale: run python -m ps_common.settings_doc --write-docs docs/settings.md"


def test_the_modes_are_the_servers_modes() -> None:
    from ps_server.config import MODES

    assert jobconfig.MODES == MODES


def test_trainable_patterns_and_the_expected_count_come_from_the_job_file_and_flags(
        tmp_path: Path) -> None:
    path = write(tmp_path, '[worker]\ninclude = ["*", "log_temp"]\nexpect_parameters = 4\n')
    config = load(["--config", path, "--exclude", "gamma,beta*"], scope="launch")
    assert config.worker.include == ["*", "log_temp"]
    assert config.worker.exclude == ["gamma", "beta*"]
    assert config.worker.expect_parameters == 4
    child = jobconfig.to_argv(config, scope="worker")
    assert child[child.index("--include") + 1] == "*,log_temp"
    assert child[child.index("--expect-parameters") + 1] == "4"


PIPELINE_CLUSTER = {"ps": ["ps0:2222", "ps1:2222", "ps2:2222", "ps3:2222"],
                    "worker": ["w0:3333", "w1:3333", "w2:3333", "w3:3333", "w4:3333", "w5:3333"]}


def _pipeline_tf(task: dict) -> dict[str, str]:
    return {"TF_CONFIG": json.dumps({"cluster": PIPELINE_CLUSTER, "task": task})}


def test_tf_config_places_a_pipeline_stage_worker_next_to_its_replica_and_its_stage_shards() -> None:
    # 2 stages: ps0, ps1 are stage 0's shards, ps2, ps3 stage 1's; workers replica by replica
    config = load(["--stages", "2"], scope="worker", env=_pipeline_tf({"type": "worker", "index": 1, "stage": 1}))
    assert (config.worker.index, config.worker.stage, config.job.workers) == (1, 1, 3)
    assert config.worker.servers == ["ps2:2222", "ps3:2222"] and config.job.shards == 2
    assert config.worker.stage_listen == "0.0.0.0:3333"
    assert config.worker.stage_peers == ["w2:3333", "-"]
    first = load(["--stages", "2"], scope="worker", env=_pipeline_tf({"type": "worker", "index": 2, "stage": 0}))
    assert first.worker.stage_peers == ["-", "w5:3333"] and first.worker.servers == ["ps0:2222", "ps1:2222"]


def test_tf_config_makes_a_pipeline_ps_task_a_shard_of_its_stage() -> None:
    config = load(["--stages", "2"], scope="server", env=_pipeline_tf({"type": "ps", "index": 3}))
    assert (config.server.shard_index, config.job.shards) == (1, 2)


@pytest.mark.parametrize("task,stages,match", [
    ({"type": "worker", "index": 0}, 2, "task has no \"stage\""),
    ({"type": "worker", "index": 0, "stage": 1}, 3, "not a multiple of stages = 3"),
    ({"type": "worker", "index": 0, "stage": -1}, 2, "task.stage must be an integer >= 0"),
])
def test_a_pipeline_tf_config_that_does_not_fit_says_why(task: dict, stages: int, match: str) -> None:
    with pytest.raises(JobConfigError, match=match):
        load(["--stages", str(stages)], scope="worker", env=_pipeline_tf(task))


def test_pipeline_settings_are_checked_against_each_other() -> None:
    with pytest.raises(JobConfigError, match="3 stages need 2 cuts"):
        load(["--stages", "3", "--cuts", "a", "--servers", "h:1"], scope="worker")
    with pytest.raises(JobConfigError, match="must be < stages"):
        load(["--stages", "2", "--stage", "2", "--servers", "h:1"], scope="worker")
    with pytest.raises(JobConfigError, match="do not train sparse tables"):
        load(["--stages", "2", "--sparse-min-rows", "10"], scope="launch")
    with pytest.raises(JobConfigError, match="do not train sparse tables.*--dynamic-tables"):
        load(["--stages", "2", "--dynamic-tables", "emb"], scope="launch")


def test_dynamic_table_settings_are_read_and_a_bad_initializer_is_refused() -> None:
    job = load(["--dynamic-tables", "a,b", "--dynamic-initializer", "uniform:0.1", "--evict-after-steps", "50"],
               scope="launch")
    assert job.worker.dynamic_tables == ["a", "b"]
    assert (job.worker.dynamic_initializer, job.worker.evict_after_steps) == ("uniform:0.1", 50)
    assert load([], scope="launch").worker.dynamic_initializer == "normal:0.01"
    with pytest.raises(JobConfigError, match="dynamic-initializer.*'gauss:1'.*normal:STD"):
        load(["--dynamic-initializer", "gauss:1"], scope="launch")
    with pytest.raises(JobConfigError, match="evict-after-steps"):
        load(["--evict-after-steps", "-1"], scope="launch")


@pytest.mark.parametrize("batch,expected", [(32, 4), (30, 2), (15, 1)])
def test_micro_batches_default_to_the_largest_of_4_2_1_that_divides_the_batch(batch: int, expected: int) -> None:
    config = load(["--stages", "2", "--batch-size", str(batch), "--servers", "h:1"], scope="worker")
    assert config.job.micro_batches == expected


def test_micro_batches_that_do_not_divide_the_batch_are_refused_for_a_pipeline() -> None:
    with pytest.raises(JobConfigError, match="batch_size 32 does not split into 3 equal micro-batches"):
        load(["--stages", "2", "--micro-batches", "3", "--servers", "h:1"], scope="worker")
