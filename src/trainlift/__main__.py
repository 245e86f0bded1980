from trainlift.cli import main

main()
