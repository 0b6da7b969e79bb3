"""Turn gRPC core's fork handlers off; import this before anything imports ``grpc``.

gRPC core registers ``pthread_atfork`` handlers that, while its threads are busy ("Other threads
are currently calling into gRPC, skipping fork() handlers"), leave a forked child unusable: the
llama.cpp children the runtime forks (``preexec_fn`` sets ``PR_SET_PDEATHSIG``, which forces a
real ``fork()``) were killed by SIGSEGV before reaching ``exec``. The agent never forks Python
code that uses gRPC, so the handlers are not needed. gRPC reads the variable when it is first
imported, hence this module: ``agent.main`` imports it first.
"""

from __future__ import annotations

import os

os.environ["GRPC_ENABLE_FORK_SUPPORT"] = "0"
