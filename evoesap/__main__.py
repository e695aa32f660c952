import sys

from evoesap.cli import main

sys.exit(main())
