"""The parts of `make bench` beyond cost per request: accuracy at 2 workers and across proxies,
memory against distinct keys, the quota service's throughput, where tollgate's time goes, overload,
token budgets (reserve then settle against charging after the response), and bandwidth per key
(tollgate's byte limit against nginx's limit_rate and Envoy's bandwidth_limit), and Envoy's own
protocols (RLS, RLQS) from the quota service.
Each function returns plain rows for results.json and the report.

Each section is a module of its own (`section_accuracy.py`, `section_quota.py`, `section_profile.py`,
`section_overload.py`, `section_llm.py`, `section_bandwidth.py`, `section_protocols.py`; what they share is in
`section_common.py`); this one names them for `run.py`."""
from section_accuracy import accuracy, memory
from section_bandwidth import bandwidth
from section_common import wrk_together
from section_llm import llm
from section_overload import capacity_change, overload, slowdowns
from section_profile import process_split, profile
from section_protocols import protocols
from section_quota import RedisCluster, global_load, quota_throughput

__all__ = [
    "accuracy", "memory", "bandwidth", "wrk_together", "llm", "capacity_change", "overload", "slowdowns",
    "process_split", "profile", "protocols", "RedisCluster", "global_load", "quota_throughput",
]
