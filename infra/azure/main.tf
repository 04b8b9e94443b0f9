# What the aci backend needs in Azure (backends/README.md):
#   - a resource group for the container groups;
#   - a virtual network with one subnet delegated to Container Instances: the coordinator and every worker
#     get a private IP there, and only QUIC's UDP ports are open inside it;
#   - the coordinator's user-assigned identity, with a custom role on the resource group that allows exactly
#     what the backend calls (create, read, delete container groups, read their logs and operations, join
#     the subnet, and assign the pull identity) and nothing else;
#   - optionally, a pull identity with AcrPull on the registry holding the worker image (no registry
#     passwords anywhere), and a coordinator container group in the subnet.

data "azurerm_subscription" "current" {}

resource "azurerm_resource_group" "physalia" {
  name     = var.resource_group_name
  location = var.location
}

resource "azurerm_virtual_network" "physalia" {
  name                = "physalia"
  location            = azurerm_resource_group.physalia.location
  resource_group_name = azurerm_resource_group.physalia.name
  address_space       = [var.vnet_cidr]
}

resource "azurerm_subnet" "workers" {
  name                 = "workers"
  resource_group_name  = azurerm_resource_group.physalia.name
  virtual_network_name = azurerm_virtual_network.physalia.name
  address_prefixes     = [var.subnet_cidr]

  delegation {
    name = "aci"
    service_delegation {
      name    = "Microsoft.ContainerInstance/containerGroups"
      actions = ["Microsoft.Network/virtualNetworks/subnets/action"]
    }
  }
}

# Inside the subnet only the QUIC ports are reachable; nothing comes in from outside the VNet (the workers
# have no public IP). Mutual TLS with the job's CA still decides who may talk (DESIGN invariant 5).
resource "azurerm_network_security_group" "workers" {
  name                = "physalia-workers"
  location            = azurerm_resource_group.physalia.location
  resource_group_name = azurerm_resource_group.physalia.name

  security_rule {
    name                       = "quic-within-subnet"
    priority                   = 100
    direction                  = "Inbound"
    access                     = "Allow"
    protocol                   = "Udp"
    source_port_range          = "*"
    destination_port_range     = var.quic_ports
    source_address_prefix      = var.subnet_cidr
    destination_address_prefix = var.subnet_cidr
  }

  security_rule {
    name                       = "nothing-else-inbound"
    priority                   = 4000
    direction                  = "Inbound"
    access                     = "Deny"
    protocol                   = "*"
    source_port_range          = "*"
    destination_port_range     = "*"
    source_address_prefix      = "*"
    destination_address_prefix = "*"
  }
}

resource "azurerm_subnet_network_security_group_association" "workers" {
  subnet_id                 = azurerm_subnet.workers.id
  network_security_group_id = azurerm_network_security_group.workers.id
}

# The coordinator's identity: azure_identity's ManagedIdentityCredential (feature `azure-identity`) gets
# its ARM tokens when the coordinator runs in Azure with this identity attached.
resource "azurerm_user_assigned_identity" "coordinator" {
  name                = "physalia-coordinator"
  location            = azurerm_resource_group.physalia.location
  resource_group_name = azurerm_resource_group.physalia.name
}

resource "azurerm_role_definition" "aci_launcher" {
  name        = "Physalia ACI launcher (${azurerm_resource_group.physalia.name})"
  scope       = azurerm_resource_group.physalia.id
  description = "What the physalia aci backend calls: container groups, their logs and operations, the worker subnet, the pull identity."

  permissions {
    actions = [
      "Microsoft.ContainerInstance/containerGroups/read",
      "Microsoft.ContainerInstance/containerGroups/write",
      "Microsoft.ContainerInstance/containerGroups/delete",
      "Microsoft.ContainerInstance/containerGroups/containers/logs/read",
      "Microsoft.ContainerInstance/locations/*/read",
      "Microsoft.Network/virtualNetworks/subnets/join/action",
      "Microsoft.ManagedIdentity/userAssignedIdentities/assign/action",
    ]
    not_actions = []
  }

  assignable_scopes = [azurerm_resource_group.physalia.id]
}

resource "azurerm_role_assignment" "coordinator_launches" {
  scope              = azurerm_resource_group.physalia.id
  role_definition_id = azurerm_role_definition.aci_launcher.role_definition_resource_id
  principal_id       = azurerm_user_assigned_identity.coordinator.principal_id
}

# Pulls the worker image from the registry (AciConfig.registry.identity_id).
resource "azurerm_user_assigned_identity" "pull" {
  count               = var.registry_id == null ? 0 : 1
  name                = "physalia-pull"
  location            = azurerm_resource_group.physalia.location
  resource_group_name = azurerm_resource_group.physalia.name
}

resource "azurerm_role_assignment" "pull" {
  count                = var.registry_id == null ? 0 : 1
  scope                = var.registry_id
  role_definition_name = "AcrPull"
  principal_id         = azurerm_user_assigned_identity.pull[0].principal_id
}

# The coordinator as a container group in the workers' subnet, so they reach its private IP.
resource "azurerm_container_group" "coordinator" {
  count               = var.coordinator_image == null ? 0 : 1
  name                = "physalia-coordinator"
  location            = azurerm_resource_group.physalia.location
  resource_group_name = azurerm_resource_group.physalia.name
  os_type             = "Linux"
  restart_policy      = "Never"
  ip_address_type     = "Private"
  subnet_ids          = [azurerm_subnet.workers.id]

  identity {
    type         = "UserAssigned"
    identity_ids = [azurerm_user_assigned_identity.coordinator.id]
  }

  container {
    name   = "coordinator"
    image  = var.coordinator_image
    cpu    = 1
    memory = 2

    ports {
      port     = 7000
      protocol = "UDP"
    }

    environment_variables = {
      AZURE_CLIENT_ID = azurerm_user_assigned_identity.coordinator.client_id
    }
  }
}
