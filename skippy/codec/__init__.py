"""The stage data plane's wire: its vocabulary, the sans-IO codec and skippy's extensions.

Strategy: ``protocol`` (the v11 values and frame types) and ``protocol_ext`` (the negotiated
extensions) name things and never read bytes; ``wire`` is the codec's one API, which picks the
Cython module ``_wire`` or its typed pure-Python twin ``_wire_py`` (with ``_wire_ext_py`` and
``_activation_py``) at import; ``decode_run`` is a decode run's request (``docs/protocol.md``
§11), written by the driver and parsed by the first stage; ``wire_cli`` is ``python -m
skippy.codec.wire``.  Nothing here does I/O or imports trio, the network layer, the runtime or
the stage (``tests/test_layout_nevers.py`` reads the imports).  This module imports nothing, so
importing the vocabulary does not load the codec.
"""
