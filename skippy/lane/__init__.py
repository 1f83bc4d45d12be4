"""A stage lane's rules, sans-IO: what a lane does with each message, who carries each action out.

This package imports nothing heavy (no trio, no sockets, no runtime or libllama): a test imports
it in a fresh interpreter and lists ``sys.modules``.  The stage's connection module moves the
bytes and calls these rules at each event.
"""
