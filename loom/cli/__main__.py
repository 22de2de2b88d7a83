from loom.cli import main

main()
