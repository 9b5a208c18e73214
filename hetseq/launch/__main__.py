from hetseq.launch.launcher import main

main()
