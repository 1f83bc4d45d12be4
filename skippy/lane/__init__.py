"""A stage lane's rules, sans-IO: what a lane does with each message, who carries each action out.

Modules: ``protocol`` (the per-kind rules table and :class:`~skippy.lane.protocol.StageLane`, all
of a lane's state), ``placement`` (who performs each step: a shortcut is a placement), ``messages``
(work items, forwarded frames and predictions built from messages), ``work`` (the runtime's work
item and result), ``replies`` (every reply a stage builds), ``driver`` (the driver's end of a lane
on the same rules), ``decode_run`` (§11 runs), ``timings`` (direct-return timing totals),
``registry`` (the stage's working lanes), ``stats`` (reply-stats arithmetic), ``errors`` (the typed
refusals and their wire codes).

This package imports nothing heavy (no trio, no sockets, no runtime or libllama): a test imports
it in a fresh interpreter and lists ``sys.modules``.  The stage's connection module moves the
bytes and calls these rules at each event.
"""
