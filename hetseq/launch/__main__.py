from hetseq.launch.main import main

main()
