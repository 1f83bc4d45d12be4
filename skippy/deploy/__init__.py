"""Deployment: planning a chain over hosts and starting it, on this machine or on a Ray cluster.

Strategy: ``plan`` splits a model's layers over hosts from the GGUF header alone (memory, speed)
and writes the plan file a stage reads with ``--plan-stage``; ``ray_plan`` lists a Ray cluster's
hosts and measures decode time on its nodes; ``launch`` starts a chain's stage processes here,
final stage first, then the API; ``ray_launch`` places them on a Ray cluster; ``certs`` makes a
chain's certificate authority and its members' certificates.  The ``skippy plan / up / certs``
commands drive them; the driver and the API never import them, and a stage only reads ``plan``'s
file keys (``--plan-stage``).  This module imports nothing (Ray and ``cryptography`` load only
with the modules that use them).
"""
