from fleetwarden.cli import main

main()
