"""The cost model the ring's calls and the planner share: bytes per comm (traffic.py), and the choice of the comm
(``comm="auto"``) and of the relay's pieces per hop from a device's costs (comm_choice.py), under the comm names
(comm_names.py). Numbers only: nothing here imports torch or attention/.
"""
