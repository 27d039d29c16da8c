"""Shared pytest setup: hypothesis profiles (CI runs a fixed, derandomized number of examples).

Convention of every test and of the conformance vectors: a request is written (num_cached, num_new), or
(request_id, num_cached, num_new), the argument order of ``BatchBuilder.add``. Only the command lines read
``--request TOKENS@CACHED`` (new tokens first, as ``dspark_abi.cli.common.parse_request`` returns them).
"""

import os

from hypothesis import HealthCheck, settings

settings.register_profile("ci", max_examples=40, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
settings.register_profile("dev", max_examples=25, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
settings.register_profile("thorough", max_examples=500, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))
