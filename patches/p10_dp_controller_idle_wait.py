"""SGLang's DP attention controller: wait for the next request instead of spinning a core.

What it changes, in the installed sglang 0.5.23: `srt/managers/data_parallel_controller.py`,
`DataParallelController.event_loop`. Stock drains the tokenizer's socket with non-blocking
receives and, when it is empty, loops straight back: the controller process (one per server
with `--attn-dp-size` > 1) keeps a core busy while the server idles. The patched loop, once the
socket is empty, waits on it (`Socket.poll`, up to 1 s, so the soft watchdog is still fed every
second): a request is dispatched as soon as it arrives, as before.

Why: measured here (2 cores, Dec 6 2026), an idle DP-attention server's controller used 8.0 s
of CPU in 10 s (`sglang::data_parallel_controller`, 97 s of CPU in a PD test module's first two
minutes). The test module that runs two such servers beside a PD pair left the PD pair one
core, and a CI run of it failed on a Mooncake master RPC that timed out at load 15.8.
"""

from __future__ import annotations

from _patchlib import Edit, edit_file, installed_file, require_sglang_version

NAME = "dp-controller-idle-wait"
MARKER = "hiradix-patch: dp-controller-idle-wait"
POLL_TIMEOUT_MS = 1000

ANCHOR = """                try:
                    recv_req = sock_recv(self.recv_from_tokenizer, flags=zmq.NOBLOCK)
                except zmq.ZMQError:
                    break
                self._request_dispatcher(recv_req)
"""
REPLACEMENT = f"""                try:
                    recv_req = sock_recv(self.recv_from_tokenizer, flags=zmq.NOBLOCK)
                except zmq.ZMQError:
                    break
                self._request_dispatcher(recv_req)
            # {MARKER} (hiradix patches/p10_dp_controller_idle_wait.py):
            # the socket is empty: wait for the next request (stock spins a core here).
            self.recv_from_tokenizer.poll(timeout={POLL_TIMEOUT_MS})
"""


def apply() -> tuple[str, str]:
    require_sglang_version()
    path = installed_file("sglang", "sglang/srt/managers/data_parallel_controller.py")
    return edit_file(path, MARKER, [Edit(ANCHOR, REPLACEMENT)]), str(path)
