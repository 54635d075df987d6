"""Scale-out on Ray: data-parallel engine replicas as Ray actors (config, cluster, replica)."""
