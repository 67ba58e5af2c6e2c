"""``python -m wantrain`` (and ``torchrun -m wantrain run CONFIG``): the ``wantrain`` command line."""

import sys

from wantrain.cli.main import main

sys.exit(main())
