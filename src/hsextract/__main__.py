import sys

from hsextract.cli import main

sys.exit(main())
