"""The jobs-and-tools errors belong to the one catalog and keep the built-in bases their callers catch."""

from __future__ import annotations

import argparse

import pytest

from ps_common import errors, jobconfig


@pytest.mark.parametrize(("cls", "builtin", "reason"), [
    (errors.JobConfigError, ValueError, "JOB_CONFIG"),
    (errors.ProcessStartError, RuntimeError, "PROCESS_START"),
    (errors.LaunchError, RuntimeError, "LAUNCH_FAILED"),
])
def test_tool_errors_are_catalog_errors_that_never_cross_the_wire(cls, builtin, reason) -> None:
    assert issubclass(cls, errors.PSError) and issubclass(cls, builtin)
    assert cls.status is None
    assert errors.error_for_reason(reason) is cls
    assert errors.catalog()[reason] is cls


def test_a_bad_setting_raises_the_catalog_class_callers_know_from_jobconfig() -> None:
    parser = argparse.ArgumentParser()
    jobconfig.add_arguments(parser, scope="launch")
    with pytest.raises(errors.JobConfigError, match=r"batch_size .*: 0 "):
        jobconfig.load_config(parser.parse_args(["--batch-size", "0"]), scope="launch")
    assert jobconfig.JobConfigError is errors.JobConfigError
