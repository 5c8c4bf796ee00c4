from prfaas.cli import main

main()
