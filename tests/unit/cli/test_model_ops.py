"""`layercast model ops`: each target's estimated load time beside the measured one."""

from services.cli.app import scale_op_rows


def test_each_target_shows_its_estimate_beside_its_measured_load_time():
    ops = [
        {"scale_op_id": "op-1", "direction": "up", "state": "done", "from_instances": 1, "to_instances": 3,
         "plan": {"targets": ["w2", "w1"], "estimated_load_s": {"w2": 0.3333, "w1": 0.8},
                  "measured_load_s": {"w2": 0.41}}},
        {"scale_op_id": "op-2", "direction": "up", "state": "running", "from_instances": 3, "to_instances": 4,
         "plan": {"targets": ["w3"], "estimated_load_s": {"w3": 1.5}}},
        {"scale_op_id": "op-3", "direction": "down", "state": "done", "from_instances": 4, "to_instances": 2,
         "plan": {"kind": "drain", "victims": ["i1", "i2"]}},
    ]
    assert scale_op_rows(ops) == [
        ("op-1", "up", "done", "1 -> 3", "w2", "0.333", "0.410"),
        ("op-1", "up", "done", "1 -> 3", "w1", "0.800", "-"),  # its target never loaded
        ("op-2", "up", "running", "3 -> 4", "w3", "1.500", "-"),  # still loading
        ("op-3", "down", "done", "4 -> 2", "-", "-", "-"),
    ]
