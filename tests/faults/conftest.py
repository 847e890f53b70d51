import os
import sys

# The helpers of this folder (runs.py, injected learners and rewards) import by module name: in the test process,
# in the Ray actors an in-process run starts (they inherit PYTHONPATH), and in runs started by runs.py.
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
os.environ["PYTHONPATH"] = os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")])
