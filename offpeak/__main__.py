from offpeak.cli import main

main()
