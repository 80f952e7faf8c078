"""The online controller: learns each workload's reuse model and tunes the queue live."""
