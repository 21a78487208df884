"""The operator's application: the ``fleet`` command (its CLI modules), the local stack's
supervisor and layout, the demo and the operator console.

It sits on top of the project: it may import the kernel (``fleet``), ``deploy``, ``policy``,
``registry`` and ``memory``; nothing imports it (services are started by name, ``fleet serve ID``).
"""
