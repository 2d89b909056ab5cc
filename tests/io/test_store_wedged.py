"""A store call that runs past the worker's limit (a wedged Mooncake client) ends the I/O worker
by that limit; its jobs fail as "worker died" (the core releases their DRAM pages) and a fresh
worker serves the store again. That exit is the store's failure: it does not count toward the
client's bound on crashes (which would switch the NVMe tier off).

Mooncake 0.3.13's TCP transport can deadlock inside a put (two clients putting into a full
store; the soak's servers stopped writing and held their PUTs' DRAM pages for good). That
deadlock does not come on demand, so here the call is held past the limit by a real cause: a
frozen holder with a transfer timeout far above the limit. Real master and holder on loopback.
"""

from __future__ import annotations

import logging
import time

import msgspec

from hiradix.io.client import IOWorkerClient
from hiradix.io.protocol import JobDone
from hiradix.io.worker import WEDGED_STORE_EXIT_CODE
from hiradix.testing.mooncake import MIN_SEGMENT_BYTES, MooncakeCluster
from tests.helpers.io import WAIT_S, fill, page_bytes, wait_exit, wait_for
from tests.helpers.store import requires_mooncake

LIMIT_S = 1.5  # the worker's store call limit in this test
TRANSFER_TIMEOUT_S = 30  # what a frozen holder would cost a put without the limit
MARGIN_S = 4.0  # poll period, exit and scheduling noise on a shared 2-core machine


@requires_mooncake
def test_a_store_call_past_its_limit_ends_the_worker_and_fails_its_jobs(spec, pool, tmp_path, caplog, capfd):
    caplog.set_level(logging.WARNING, logger="hiradix.io.client")
    with MooncakeCluster(num_holders=1, holder_segment_bytes=MIN_SEGMENT_BYTES, log_dir=tmp_path,
                         transfer_timeout_s=TRANSFER_TIMEOUT_S) as cluster:  # fmt: skip
        wspec = msgspec.structs.replace(spec, store_backend="mooncake", store_config=cluster.config_json(),
                                        store_call_limit_s=LIMIT_S)  # fmt: skip
        # max_respawns=0: one crash would disable the client (and the NVMe tier with it)
        with IOWorkerClient(wspec, ready_timeout_s=WAIT_S, max_respawns=0) as client:
            fill(pool, range(8), seed=5)
            keys = [f"wedge/{i}" for i in range(4)]
            client.submit_put(1, [0, 1, 2, 3], keys)
            assert wait_for(client, {1})[1].ok == [True] * 4
            pid = client.pid
            cluster.freeze_holder(0)
            try:
                started = time.monotonic()
                client.submit_put(2, [4, 5, 6, 7], [f"wedge/{i}" for i in range(4, 8)])
                assert wait_exit(pid, timeout_s=LIMIT_S + MARGIN_S), "the worker outlived its store call limit"
                elapsed_s = time.monotonic() - started
                assert client.check_alive() is False
                assert client.poll() == [JobDone(job_id=2, ok=[False] * 4, error="worker died")]
            finally:
                cluster.thaw_holder(0)
            assert LIMIT_S <= elapsed_s < LIMIT_S + MARGIN_S, elapsed_s
            assert f"died with status {WEDGED_STORE_EXIT_CODE}" in caplog.text
            # the worker's log names the call and shows where it waits (every thread's stack)
            worker_log = capfd.readouterr().err
            assert "a cluster-store call (batch_put_from_multi_buffers, 4 keys) has run for" in worker_log, worker_log
            assert "in _call" in worker_log and "Thread 0x" in worker_log, worker_log
            assert client.respawns == 1 and client.pid not in (None, pid)
            assert client.store_wedges == 1 and not client.disabled
            # the fresh worker has a fresh store client: what the first put stored reads back
            client.submit_get(3, keys, [16, 17, 18, 19])
            assert wait_for(client, {3})[3].ok == [True] * 4
            assert [page_bytes(pool, 16 + i) for i in range(4)] == [page_bytes(pool, i) for i in range(4)]

