from hookcli.cli import main

main()
