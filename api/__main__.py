import sys
from tierserve.deploy.cli import main

sys.exit(main())
