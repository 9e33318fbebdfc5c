import sys

from leanlm.cli.main import main

sys.exit(main())
