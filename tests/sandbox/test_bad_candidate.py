"""One candidate of a harness iteration that sends a malformed RPC frame ends only its own episodes: the
iteration still scores the others and the run goes on (issue 10). End to end through the real entry point,
`Coordinator(cfg, base_model).run()`, with the agent-cli proposer running a plain shell command (in its
jail) that writes two candidates: a good variant of h0 and one that writes a frame which used to make the
host-side parser raise (an error message whose `kind` is a list: unhashable)."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest

from actors.coordinator import Coordinator
from tests.helpers import small_config
from whale_ray.archive import Archive
from whale_ray.run_state import RunState
from whale_ray.sandbox.isolation import find_bwrap

pytestmark = [pytest.mark.slow, pytest.mark.skipif(find_bwrap() is None, reason="bubblewrap is not installed")]

BAD = '''import os, struct


def run(task, agent):
    data = b'{"type":"error","kind":[1],"error":"x","traceback":""}'
    os.write(agent._channel.fd, struct.pack(">I", len(data)) + data)
    os._exit(0)
'''

# The whole "agent": a POSIX shell script, written by the proposer's command line into the jail's workspace.
SCRIPT = f"""set -e
c=/workspace/candidates
mkdir -p $c/a-good $c/b-bad-frame
sed 's/MAX_TURNS = 2/MAX_TURNS = 3/' /archive/h0/harness.py > $c/a-good/harness.py
echo 'three turns instead of two' > $c/a-good/hypothesis.md
cat > $c/b-bad-frame/harness.py <<'EOF'
{BAD}EOF
echo 'a malformed RPC frame' > $c/b-bad-frame/hypothesis.md
"""


def test_a_candidate_sending_a_bad_frame_does_not_stop_the_iteration(tmp_path, ray_cluster, tiny_policy):
    cfg = small_config(tmp_path / "run", condition="mh_only", cycles=1, I=2,  # h0, then one proposal iteration
                       adaptive__harness_min_iterations=1, adaptive__harness_max_iterations=2,
                       harness_phase__proposer="agent-cli",
                       harness_phase__agent_cli__command=["/bin/sh", "-c", SCRIPT],
                       harness_phase__agent_cli__network=False)
    Coordinator(cfg, tiny_policy).run()

    state = RunState.load(cfg.run_dir)
    assert state.finished
    archive = Archive(cfg.run_dir / "archive")
    by_hyp = {c.hypothesis: c for c in archive.candidates()}
    good, bad = by_hyp["three turns instead of two"], by_hyp["a malformed RPC frame"]
    assert good.status == "evaluated"  # scored on D_harness despite its sibling
    assert bad.status in ("invalid", "evaluated")  # rejected at its smoke test (or scored 0), never a crash
    statuses = {}
    for path in (cfg.run_dir / "rollouts").glob("*.parquet"):
        t = pq.read_table(path, columns=["harness_id", "status", "reason"]).to_pylist()
        for row in t:
            statuses.setdefault(row["harness_id"], set()).add(row["status"])
            if row["harness_id"] == bad.id:
                assert "malformed error message" in row["reason"], row
    assert statuses[bad.id] == {"protocol_error"}  # each of its episodes, answered; none crashed the host
    assert "sandbox_error" not in set().union(*statuses.values())
    assert statuses[good.id] <= {"ok", "harness_exception", "timeout", "memory_limit", "output_limit", "crashed"}
