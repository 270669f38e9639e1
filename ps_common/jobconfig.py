"""The job's settings: one typed config fed by a TOML job file, TF_CONFIG and command-line flags.

One job file describes the whole job -- ``[job]`` (mode, workers, shards, ...), ``[server]``
(optimizer, checkpoints, ...), ``[worker]`` (model, data, batch size, ...) and ``[launch]``
(for ``ps-launch``) -- so every process of the job can be started with the same file. Each
setting is declared once (`ps_common.settings`) with its flags, the commands that take
it, its TF_CONFIG mapping and its help; the flags, the job-file checks, the launcher's
command lines for its children and docs/settings.md are all derived from those declarations.

Precedence, lowest first: the defaults, the job file (``--config``), ``TF_CONFIG`` (for
``ps-server`` and ``ps-worker``), the command-line flags. ``load_config`` applies them in
that order, resolves the settings that default to others (``workers``,
``replicas_to_aggregate``, ``steps``, ``worker_id``, ``shards`` from ``servers``) and
validates the result; every error names the setting, where its value came from and the value.

How TF_CONFIG maps to settings is in `ps_common.tf_config`; the declarations of the
settings are in `ps_common.settings`; docs/settings.md's tables come from
`ps_common.settings_doc`.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ps_common.dynamic_ids import parse_initializer
from ps_common.errors import JobConfigError  # noqa: F401 -- callers catch it as jobconfig.JobConfigError
from ps_common.settings import (  # noqa: F401 -- re-exported: the settings' public names live here too
    DEFAULT_STEPS,
    LOG_LEVELS,
    MODES,
    SCOPES,
    SECTIONS,
    JobSettings,
    LaunchSettings,
    ServerSettings,
    SettingInfo,
    WorkerSettings,
    iter_settings,
    settings_by_name,
)
from ps_common.tf_config import (TF_CONFIG_ENV, TFConfig, parse_tf_config, pipeline_settings,  # noqa: F401
                                 split_address, tf_config_settings)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib


@dataclass
class JobConfig:
    """Every setting of a job, by section; `sources` says where each non-default value came from."""

    job: JobSettings = field(default_factory=JobSettings)
    server: ServerSettings = field(default_factory=ServerSettings)
    worker: WorkerSettings = field(default_factory=WorkerSettings)
    launch: LaunchSettings = field(default_factory=LaunchSettings)
    sources: dict[str, str] = field(default_factory=dict)   # "section.key" -> "job.toml", "TF_CONFIG", "--flag"

    def get(self, name: str) -> Any:
        """The value of "section.key"."""
        section, key = name.split(".", 1)
        return getattr(getattr(self, section), key)

    def set(self, name: str, value: Any, source: str) -> None:
        """Sets "section.key" and records where the value came from."""
        section, key = name.split(".", 1)
        setattr(getattr(self, section), key, value)
        self.sources[name] = source

    def source(self, name: str) -> str:
        return self.sources.get(name, "default")

    def optimizer_hyperparameters(self) -> dict[str, Any]:
        """lr, the dedicated hyperparameters that are set, and optimizer_params (which win)."""
        params: dict[str, Any] = {"lr": self.server.lr}
        for key in ("momentum", "nesterov", "weight_decay", "beta1", "beta2", "eps"):
            value = getattr(self.server, key)
            if value is not None:
                params[key] = value
        params.update(self.server.optimizer_params)
        return params

    def as_dict(self) -> dict[str, dict[str, Any]]:
        """The settings as plain data (inf staleness as the string "inf"), for records and logs."""
        out: dict[str, dict[str, Any]] = {}
        for info in iter_settings():
            value = self.get(info.name)
            if isinstance(value, float) and math.isinf(value):
                value = "inf"
            out.setdefault(info.section, {})[info.key] = value
        return out


# ---------------------------------------------------------------- values

def parse_value(text: str) -> bool | int | float | str:
    """A hyperparameter value from text: bool, int, float, or the text itself."""
    low = text.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def _parse_pairs(items: Sequence[str], what: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise JobConfigError(f"Invalid {what} {item!r}: expected KEY=VALUE")
        out[key.strip()] = parse_value(value.strip())
    return out


def _match_choice(info: SettingInfo, text: str) -> str:
    """The choice `text` names, ignoring case ("info" -> "INFO"); other text unchanged (checked later)."""
    for choice in info.choices or ():
        if text.lower() == choice.lower():
            return choice
    return text


def _toml_value(info: SettingInfo, value: Any, where: str) -> Any:
    """A job-file value checked (and converted) against the setting's type."""
    base = info.base

    def bad(expected: str) -> JobConfigError:
        return JobConfigError(f"{where}: [{info.section}] {info.key} = {value!r}: expected {expected}")

    if base is bool:
        if not isinstance(value, bool):
            raise bad("true or false")
        return value
    if base is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad("an integer")
        return value
    if base is float:
        if isinstance(value, str) and value.strip().lower() in ("inf", "+inf", "infinity"):
            return math.inf
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad("a number")
        return float(value)
    if base is str:
        if not isinstance(value, str):
            raise bad("a string")
        return _match_choice(info, value)
    if base is list:
        if isinstance(value, str):
            return [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise bad("a list of strings")
        return list(value)
    if base is dict:
        if not isinstance(value, dict) or not all(isinstance(v, (bool, int, float, str)) for v in value.values()):
            raise bad("a table of numbers, booleans or strings")
        return dict(value)
    raise AssertionError(f"unhandled setting type {info.hint!r}")


# ---------------------------------------------------------------- job file

def read_job_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The parsed TOML job file; JobConfigError naming the file for a missing or malformed one."""
    p = Path(path)
    try:
        with p.open("rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise JobConfigError(f"job file {str(p)!r} does not exist ({p.resolve()})") from None
    except tomllib.TOMLDecodeError as exc:
        raise JobConfigError(f"job file {str(p)!r} is not valid TOML: {exc}") from exc
    except UnicodeDecodeError as exc:   # tomllib decodes UTF-8; the bare message named no file
        raise JobConfigError(f"job file {str(p)!r} is not UTF-8 text (byte {exc.object[exc.start]:#04x} at "
                             f"position {exc.start}); save it as UTF-8") from None
    except OSError as exc:
        raise JobConfigError(f"job file {str(p)!r} cannot be read: {exc}") from exc


def apply_job_file(config: JobConfig, data: Mapping[str, Any], *, source: str) -> None:
    """Sets every setting the job file holds; unknown tables or keys are errors listing the known ones."""
    known = settings_by_name()
    for section, table in data.items():
        if section not in SECTIONS:
            raise JobConfigError(f"{source}: unknown table [{section}]; the tables are "
                                 f"{', '.join(f'[{s}]' for s in SECTIONS)}")
        if not isinstance(table, dict):
            raise JobConfigError(f"{source}: {section} = {table!r} must be a table ([{section}])")
        for key, value in table.items():
            info = known.get(f"{section}.{key}")
            if info is None or not info.toml:
                keys = [i.key for i in known.values() if i.section == section and i.toml]
                why = "is set per process (flag or TF_CONFIG), not in a job file" if info else "is not a setting"
                raise JobConfigError(f"{source}: [{section}] {key} {why}; the [{section}] keys are {', '.join(keys)}")
            config.set(info.name, _toml_value(info, value, source), source)


# ---------------------------------------------------------------- flags

def _flag_type(info: SettingInfo):
    base = info.base

    def convert(text: str) -> Any:
        try:
            if base is int:
                return int(text)
            if base is float:
                value = float(text)
                if math.isnan(value):
                    raise ValueError(text)
                return value
        except ValueError:
            kind = "an integer" if base is int else "a number"
            raise argparse.ArgumentTypeError(f"expected {kind}, got {text!r}") from None
        if base is list:
            return [part.strip() for part in text.split(",") if part.strip()]
        return _match_choice(info, text)

    convert.__name__ = base.__name__
    return convert


def add_arguments(parser: argparse.ArgumentParser, *, scope: str) -> None:
    """Adds --config and the flag of every setting the command `scope` takes (defaults suppressed)."""
    if scope not in SCOPES:
        raise ValueError(f"Invalid scope: {scope!r} (choose one of {', '.join(SCOPES)})")
    parser.add_argument("--config", metavar="JOB.toml", default=argparse.SUPPRESS,
                        help="the job file; flags override it" + ("" if scope == "launch" else
                                                                   " (and TF_CONFIG, which overrides it)"))
    groups: dict[str, argparse._ArgumentGroup] = {}
    for info in iter_settings():
        if scope not in info.scopes or not info.flags:
            continue
        group = groups.get(info.section)
        if group is None:
            group = groups[info.section] = parser.add_argument_group(f"[{info.section}] settings")
        default = info.default_doc or (None if info.default in (None, [], {}) else info.default)
        text = info.help + (f" (default: {default})" if default is not None else "")
        kwargs: dict[str, Any] = {"dest": info.name, "default": argparse.SUPPRESS, "help": text.replace("%", "%%")}
        if info.base is bool:
            group.add_argument(*info.flags, action=argparse.BooleanOptionalAction, **kwargs)
            continue
        if info.base is dict:
            group.add_argument(*info.flags, action="append", metavar=info.metavar, **kwargs)
            continue
        if info.choices:
            kwargs["choices"] = info.choices
        if not info.choices:
            kwargs["metavar"] = info.metavar or {int: "N", float: "X"}.get(info.base, info.key.upper())
        group.add_argument(*info.flags, type=_flag_type(info), **kwargs)


def apply_flags(config: JobConfig, namespace: argparse.Namespace) -> None:
    """Sets every setting given on the command line."""
    known = settings_by_name()
    for name, value in vars(namespace).items():
        info = known.get(name)
        if info is None:
            continue
        if info.base is dict:   # flags add to (and override keys of) the job file's table
            value = {**config.get(name), **_parse_pairs(value, info.flags[0])}
        config.set(name, value, info.flags[0])


def to_argv(config: JobConfig, *, scope: str, skip: Sequence[str] = ()) -> list[str]:
    """Flags that reproduce, for the command `scope`, every non-default setting it takes (for launchers)."""
    argv: list[str] = []
    for info in iter_settings():
        if scope not in info.scopes or not info.flags or info.name in skip:
            continue
        value = config.get(info.name)
        if value is None or value == info.default:
            continue
        flag = info.flags[0]
        if info.base is bool:
            argv.append(flag if value else "--no-" + flag[2:])
        elif info.base is dict:
            for key, item in value.items():
                argv += [flag, f"{key}={str(item).lower() if isinstance(item, bool) else item}"]
        elif info.base is list:
            argv += [flag, ",".join(value)]
        elif isinstance(value, float) and math.isinf(value):
            argv += [flag, "inf"]
        else:
            argv += [flag, str(value)]
    return argv


# ---------------------------------------------------------------- resolve and validate

#: What micro_batches = 0 (auto) may become, largest first: the first that divides the batch size.
AUTO_MICRO_BATCHES = (4, 2, 1)


def resolve(config: JobConfig) -> None:
    """Fills the settings that default to others (see each setting's documented default)."""
    job, worker = config.job, config.worker
    if job.workers is None:
        job.workers = job.replicas_to_aggregate or 1
    if job.replicas_to_aggregate is None:
        job.replicas_to_aggregate = job.workers
    if worker.servers and "job.shards" not in config.sources:
        job.shards = len(worker.servers)
    if worker.steps is None and worker.epochs is None:
        worker.steps = DEFAULT_STEPS
    if worker.worker_id is None:
        worker.worker_id = f"worker{worker.index}"
    if job.micro_batches == 0:   # auto: the largest of 4, 2, 1 that divides the batch
        job.micro_batches = next(m for m in AUTO_MICRO_BATCHES if worker.batch_size % m == 0)


def _fail(config: JobConfig, info: SettingInfo, why: str) -> JobConfigError:
    value = config.get(info.name)
    shown = "inf" if isinstance(value, float) and math.isinf(value) else repr(value)
    return JobConfigError(f"Invalid {info.where()}: {shown} (from {config.source(info.name)}): {why}")


def validate(config: JobConfig, *, scope: str) -> None:
    """Checks every value and the relations between them; JobConfigError names the first bad one."""
    known = settings_by_name()
    for info in known.values():
        value = config.get(info.name)
        if value is None:
            if not info.optional:
                raise _fail(config, info, "must be set")
            continue
        if info.choices and value not in info.choices:
            raise _fail(config, info, f"choose one of {', '.join(info.choices)}")
        if info.base in (int, float) and not isinstance(value, bool):
            if info.minimum is not None and not value >= info.minimum:
                minimum = int(info.minimum) if float(info.minimum).is_integer() else info.minimum   # 8388608, not 8.38861e+06
                raise _fail(config, info, f"must be >= {minimum}")
            if info.positive and not value > 0:
                raise _fail(config, info, "must be > 0")
    job, worker = config.job, config.worker
    if not math.isinf(job.staleness) and job.staleness != int(job.staleness):
        raise _fail(config, known["job.staleness"], "must be a whole number or inf")
    for name, mode in (("job.staleness", "ssp"), ("job.max_staleness", "async")):
        # a bound of another mode changes nothing: a user who set it expects it to hold
        if job.mode != mode and name in config.sources and config.get(name) != known[name].default:
            raise _fail(config, known[name], f"applies only in mode {mode}, and this job's mode is {job.mode} "
                                             f"(from {config.source('job.mode')}): drop it, or use --mode {mode}")
    if job.replicas_to_aggregate is not None and job.workers is not None and job.replicas_to_aggregate > job.workers:
        raise _fail(config, known["job.replicas_to_aggregate"],
                    f"must be <= workers ({job.workers}, from {config.source('job.workers')})")
    if scope == "server" and not config.server.shard_index < job.shards:
        raise _fail(config, known["server.shard_index"],
                    f"must be < shards ({job.shards}, from {config.source('job.shards')})")
    if scope == "server" and config.server.port > 65535:
        raise _fail(config, known["server.port"], "must be <= 65535")
    if scope in ("worker", "launch") and job.workers is not None and not worker.index < job.workers:
        raise _fail(config, known["worker.index"],
                    f"must be < workers ({job.workers}, from {config.source('job.workers')})")
    if scope == "worker":
        if not worker.servers:
            raise _fail(config, known["worker.servers"], "a worker needs the shards' addresses (or TF_CONFIG)")
        if len(worker.servers) != job.shards:
            raise _fail(config, known["worker.servers"],
                        f"{len(worker.servers)} addresses for shards = {job.shards} "
                        f"(from {config.source('job.shards')})")
        for address in worker.servers:
            try:
                split_address(address)
            except JobConfigError as exc:
                raise _fail(config, known["worker.servers"], str(exc)) from None
    if scope == "worker" and not worker.stage < job.stages:
        raise _fail(config, known["worker.stage"], f"must be < stages ({job.stages}, from {config.source('job.stages')})")
    if job.stages > 1 and worker.batch_size % job.micro_batches:
        raise _fail(config, known["job.micro_batches"],
                    f"batch_size {worker.batch_size} does not split into {job.micro_batches} equal micro-batches")
    if job.cuts and len(job.cuts) != job.stages - 1:
        raise _fail(config, known["job.cuts"], f"{job.stages} stages need {job.stages - 1} cuts")
    if worker.stage_peers and len(worker.stage_peers) != 2:
        raise _fail(config, known["worker.stage_peers"], "give two addresses: the previous stage's and the next's "
                                                         "('-' for none)")
    if job.stages > 1 and (worker.sparse_tables or worker.sparse_min_rows is not None or worker.dynamic_tables):
        raise _fail(config, known["job.stages"], "pipeline stages do not train sparse tables yet; drop "
                                                 "--sparse-tables / --sparse-min-rows / --dynamic-tables")
    try:
        parse_initializer(worker.dynamic_initializer)
    except ValueError:
        raise _fail(config, known["worker.dynamic_initializer"],
                    "use zeros, normal:STD or uniform:A with STD, A > 0") from None
    if config.launch.min_accuracy is not None and config.launch.min_accuracy > 1:
        raise _fail(config, known["launch.min_accuracy"], "must be <= 1")


def load_config(namespace: argparse.Namespace, *, scope: str, env: Mapping[str, str] | None = None) -> JobConfig:
    """The job's settings for command `scope`: defaults, then --config, TF_CONFIG, flags; resolved and validated.

    TF_CONFIG is read from `env` (default os.environ) for the server and worker commands
    only; the launcher runs its own local cluster.
    """
    env = os.environ if env is None else env
    config = JobConfig()
    path = getattr(namespace, "config", None)
    if path:
        apply_job_file(config, read_job_file(path), source=str(path))
    tf_text = env.get(TF_CONFIG_ENV, "").strip()
    tf = parse_tf_config(tf_text) if tf_text and scope in ("server", "worker") else None
    if tf is not None:
        for name, value in tf_config_settings(tf, scope=scope).items():
            config.set(name, value, "TF_CONFIG")
    apply_flags(config, namespace)
    if tf is not None and config.job.stages > 1:   # known only now: a flag may set it
        for name, value in pipeline_settings(tf, config.job.stages, scope=scope).items():
            if not config.source(name).startswith("--"):   # flags win, as everywhere
                config.set(name, value, "TF_CONFIG")
    resolve(config)
    validate(config, scope=scope)
    return config
