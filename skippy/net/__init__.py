"""The network layer that stages, the driver and the API share: addresses, socket I/O, TLS.

Strategy: what both ends of a stage link need and nothing of either end's protocol: ``address``
(``HOST:PORT``), ``socket_io`` (non-blocking reads and writes on a trio socket stream, parking in
trio only when the socket would block) and ``tls`` (mutual TLS 1.3 contexts and handshakes).
Frames over these streams are the stage's (:mod:`skippy.stage.transport`) and the driver's
(:mod:`skippy.driver.client`) business.  Nothing here imports the stage, the driver, the API or
the runtime (``tests/test_layout_nevers.py`` reads the imports), so a driver dials a stage without
loading the server.  This module imports nothing.
"""
