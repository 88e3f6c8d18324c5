import sys

from derivations import main

sys.exit(main())
