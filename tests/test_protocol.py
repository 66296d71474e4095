"""The message contract: validation, versions, subjects."""

import pytest
from pydantic import ValidationError

from libs.protocol import messages as m
from libs.protocol import subjects


def test_worker_commands_are_told_apart_by_op():
    load = m.WorkerCommand.model_validate({"op": "load", "instance_id": "i", "model": "x", "path": "/p",
                                           "block_start": 0, "block_end": 2})
    unload = m.WorkerCommand.model_validate({"op": "unload", "instance_id": "i"})
    assert isinstance(load.root, m.LoadModel) and isinstance(unload.root, m.UnloadModel)
    with pytest.raises(ValidationError):
        m.WorkerCommand.model_validate({"op": "explode", "instance_id": "i"})


def test_unknown_versions_and_bad_fields_are_rejected_unknown_fields_ignored():
    good = {"model": "x", "desired_instances": 1, "reason": "r"}
    assert m.ScaleRequest.model_validate({**good, "future_field": 1}).version == 1
    with pytest.raises(ValidationError):
        m.ScaleRequest.model_validate({**good, "version": 2})
    with pytest.raises(ValidationError):
        m.ScaleRequest.model_validate({**good, "desired_instances": -1})
    with pytest.raises(ValidationError):
        m.RegisterWorker.model_validate({"worker_id": "a.b", "data_address": "h:1",
                                         "topology": {"host": "h"}, "capacities": {}})


def test_subjects_live_under_the_namespace():
    names = [v for k, v in vars(subjects).items() if k.isupper() and isinstance(v, str) and k != "PREFIX"]
    names += [subjects.worker_command("w"), subjects.tokens("g", "r"), subjects.tokens_wildcard("g")]
    assert all(n.startswith(subjects.PREFIX + ".") for n in names)
    assert len(set(names)) == len(names)
