from hpctrain.cli.main import main

raise SystemExit(main())
