"""hetseq-launch: a whole job started from one command (a hostfile, SSH).

    hostfile.py   the hostfile: HOST slots=N and that node's flags
    plan.py       each node's command: ranks, world, meeting point; checked as the node would
    transport.py  how a node is reached: ssh, local
    node.py       the wrapper a node runs: environment from stdin, stopped when stdin ends
    nodes.py      the nodes as local processes: output relayed, stopped together
    main.py       the command: flags, secret, forwarded variables, summary, exit code
    check.py      --check: every host probed, one table; GPU lines on hosts without GPUs refused
    probe.py      what a host has (versions, code digest, devices, memory, interface)
"""
