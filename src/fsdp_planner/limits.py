"""The ranges the user's numbers are held to, wherever they come from (a command-line option, an API keyword, a
job config): one home so every reader refuses the same values.

The workload a model is traced with: beyond these the factory's tensors overflow torch's int64 sizes (a 16-line
C++ error once) or no machine could hold one micro-batch. 10M tokens is the longest context any model offers.
"""

from __future__ import annotations

MAX_BATCH = 1_000_000
MAX_SEQ = 10_000_000
MAX_TOKENS = 1_000_000_000  # batch x seq: a micro-batch per rank
MAX_NUMEL = 10**15  # min_nonwrapped_numel: parameters, a thousand times the largest model trained
MAX_SEARCH_EFFORT = 10**9  # search_effort: plans; the default is at most a few thousand
MIN_MFU = 1e-3  # mfu: below 0.1% of peak no GPU runs, and step times grow past any meaning
